"""Written as the original's cifar10_mobilenetv2.py is (MobileNetV2: inverted residual blocks of
1x1 expansion, depthwise 3x3 and linear 1x1 projection, ReLU6, BatchNormalization), narrow and
shallow: three blocks."""

import tensorflow as tf
from model_zoo.cifar10.data_parser import SIZE, dataset_fn, eval_metrics_fn, loss  # noqa: F401


def inverted_res_block(inputs, expansion, stride, filters, block_id):
    in_channels = inputs.shape[-1]
    prefix = f"block_{block_id}_"
    x = tf.keras.layers.Conv2D(expansion * in_channels, kernel_size=1, padding="same", use_bias=False,
                               name=prefix + "expand")(inputs)
    x = tf.keras.layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name=prefix + "expand_BN")(x)
    x = tf.keras.layers.ReLU(6.0, name=prefix + "expand_relu")(x)
    x = tf.keras.layers.DepthwiseConv2D(kernel_size=3, strides=stride, use_bias=False, padding="same",
                                        name=prefix + "depthwise")(x)
    x = tf.keras.layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name=prefix + "depthwise_BN")(x)
    x = tf.keras.layers.ReLU(6.0, name=prefix + "depthwise_relu")(x)
    x = tf.keras.layers.Conv2D(filters, kernel_size=1, padding="same", use_bias=False, name=prefix + "project")(x)
    x = tf.keras.layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name=prefix + "project_BN")(x)
    if in_channels == filters and stride == 1:
        return tf.keras.layers.Add(name=prefix + "add")([inputs, x])
    return x


def custom_model():
    inputs = tf.keras.layers.Input(shape=(SIZE, SIZE, 3), name="image")
    x = tf.keras.layers.Conv2D(8, kernel_size=3, strides=(2, 2), padding="same", use_bias=False, name="Conv1")(inputs)
    x = tf.keras.layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name="bn_Conv1")(x)
    x = tf.keras.layers.ReLU(6.0, name="Conv1_relu")(x)
    x = inverted_res_block(x, expansion=1, stride=1, filters=8, block_id=0)
    x = inverted_res_block(x, expansion=2, stride=2, filters=8, block_id=1)
    x = inverted_res_block(x, expansion=2, stride=1, filters=8, block_id=2)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(10, name="Logits")(x)
    return tf.keras.Model(inputs, outputs, name="mobilenetv2")


def optimizer(lr=0.05):
    return tf.optimizers.SGD(lr)
