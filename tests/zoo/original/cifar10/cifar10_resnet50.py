"""Written as the original's cifar10_resnet50.py is (functional ResNet: conv and identity
bottleneck blocks with BatchNormalization and shortcuts), at a depth and width that train in
seconds: one conv block and one identity block per stage, two stages."""

import tensorflow as tf
from model_zoo.cifar10.data_parser import SIZE, dataset_fn, eval_metrics_fn, loss  # noqa: F401
from tensorflow.keras import layers


def identity_block(input_tensor, kernel_size, filters, stage, block):
    filters1, filters2, filters3 = filters
    name = f"res{stage}{block}_branch"
    bn = f"bn{stage}{block}_branch"
    x = layers.Conv2D(filters1, (1, 1), use_bias=False, name=name + "2a")(input_tensor)
    x = layers.BatchNormalization(name=bn + "2a")(x)
    x = layers.Activation("relu")(x)
    x = layers.Conv2D(filters2, kernel_size, padding="same", use_bias=False, name=name + "2b")(x)
    x = layers.BatchNormalization(name=bn + "2b")(x)
    x = layers.Activation("relu")(x)
    x = layers.Conv2D(filters3, (1, 1), use_bias=False, name=name + "2c")(x)
    x = layers.BatchNormalization(name=bn + "2c")(x)
    x = layers.add([x, input_tensor])
    return layers.Activation("relu")(x)


def conv_block(input_tensor, kernel_size, filters, stage, block, strides=(2, 2)):
    filters1, filters2, filters3 = filters
    name = f"res{stage}{block}_branch"
    bn = f"bn{stage}{block}_branch"
    x = layers.Conv2D(filters1, (1, 1), strides=strides, use_bias=False, name=name + "2a")(input_tensor)
    x = layers.BatchNormalization(name=bn + "2a")(x)
    x = layers.Activation("relu")(x)
    x = layers.Conv2D(filters2, kernel_size, padding="same", use_bias=False, name=name + "2b")(x)
    x = layers.BatchNormalization(name=bn + "2b")(x)
    x = layers.Activation("relu")(x)
    x = layers.Conv2D(filters3, (1, 1), use_bias=False, name=name + "2c")(x)
    x = layers.BatchNormalization(name=bn + "2c")(x)
    shortcut = layers.Conv2D(filters3, (1, 1), strides=strides, use_bias=False, name=name + "1")(input_tensor)
    shortcut = layers.BatchNormalization(name=bn + "1")(shortcut)
    x = layers.add([x, shortcut])
    return layers.Activation("relu")(x)


def custom_model():
    inputs = tf.keras.layers.Input(shape=(SIZE, SIZE, 3), name="image")
    x = layers.Conv2D(4, (3, 3), padding="same", use_bias=False, name="conv1")(inputs)
    x = layers.BatchNormalization(name="bn_conv1")(x)
    x = layers.Activation("relu")(x)
    x = conv_block(x, 3, [2, 2, 8], stage=2, block="a", strides=(1, 1))
    x = identity_block(x, 3, [2, 2, 8], stage=2, block="b")
    x = conv_block(x, 3, [4, 4, 16], stage=3, block="a")
    x = identity_block(x, 3, [4, 4, 16], stage=3, block="b")
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    outputs = layers.Dense(10, name="fc10")(x)
    return tf.keras.models.Model(inputs, outputs, name="resnet50")


def optimizer(lr=0.02):
    return tf.optimizers.SGD(lr, momentum=0.9)
