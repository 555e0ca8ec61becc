"""Written as the original's resnet50_subclass.py is: a subclassed ResNet built from block
models imported through ``model_zoo.``, images decoded in the dataset function, Adam."""

import tensorflow as tf
from model_zoo.resnet50_subclass.resnet50_model import ConvBlock, IdentityBlock

from elasticdl.python.common.constants import Mode


class CustomModel(tf.keras.Model):
    def __init__(self, num_classes=10, **kwargs):
        super(CustomModel, self).__init__(name="resnet50", **kwargs)
        self._conv1 = tf.keras.layers.Conv2D(4, (3, 3), padding="same", use_bias=False, name="conv1")
        self._bn_conv1 = tf.keras.layers.BatchNormalization(name="bn_conv1")
        self._res2a = ConvBlock(3, [2, 2, 8], strides=(1, 1))
        self._res2b = IdentityBlock(3, [2, 2, 8])
        self._res3a = ConvBlock(3, [4, 4, 16])
        self._avg_pool = tf.keras.layers.GlobalAveragePooling2D(name="avg_pool")
        self._fc = tf.keras.layers.Dense(num_classes, name="fc")

    def call(self, inputs, training=False):
        x = tf.nn.relu(self._bn_conv1(self._conv1(inputs["image"]), training=training))
        x = self._res3a(self._res2b(self._res2a(x, training=training), training=training), training=training)
        return self._fc(self._avg_pool(x))


def loss(labels, predictions):
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        tf.reshape(labels, [-1]), predictions, from_logits=True))


def optimizer(lr=0.01):
    return tf.optimizers.Adam(lr)


def dataset_fn(dataset, mode, _):
    def _parse_data(record):
        r = tf.io.parse_single_example(record, {
            "image": tf.io.FixedLenFeature([16, 16, 3], tf.float32),
            "label": tf.io.FixedLenFeature([1], tf.int64),
        })
        features = {"image": tf.image.per_image_standardization(r["image"])}
        if mode == Mode.PREDICTION:
            return features
        return features, tf.cast(r["label"], tf.int32)

    return dataset.map(_parse_data)


def eval_metrics_fn():
    return {"accuracy": lambda labels, predictions: tf.equal(
        tf.argmax(predictions, 1, output_type=tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32))}
