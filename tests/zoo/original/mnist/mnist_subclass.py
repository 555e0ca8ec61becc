"""Written as the original's mnist_subclass.py is: a tf.keras.Model subclass, RecordIO data,
a per-example loss (reduced by ElasticDL with a warning), the original's callbacks path."""

import tensorflow as tf

from elasticdl.python.common.constants import Mode
from elasticdl.python.elasticdl.callbacks import LearningRateScheduler


class CustomModel(tf.keras.Model):
    def __init__(self, channel_last=True):
        super(CustomModel, self).__init__(name="mnist_model")
        self._reshape = tf.keras.layers.Reshape((8, 8, 1))
        self._conv1 = tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu")
        self._batch_norm = tf.keras.layers.BatchNormalization()
        self._maxpooling = tf.keras.layers.MaxPooling2D(pool_size=(2, 2))
        self._flatten = tf.keras.layers.Flatten()
        self._dense = tf.keras.layers.Dense(10)

    def call(self, inputs, training=False):
        x = self._reshape(inputs["image"])
        x = self._conv1(x)
        x = self._batch_norm(x, training=training)
        x = self._maxpooling(x)
        x = self._flatten(x)
        return self._dense(x)


def loss(labels, predictions):
    return tf.keras.losses.sparse_categorical_crossentropy(tf.reshape(labels, [-1]), predictions, from_logits=True)


def optimizer(lr=0.1):
    return tf.optimizers.SGD(lr)


def callbacks():
    return [LearningRateScheduler(lambda model_version: 0.1 if model_version < 1000 else 0.01)]


def dataset_fn(dataset, mode, _):
    def _parse_data(record):
        r = tf.io.parse_single_example(record, {
            "image": tf.io.FixedLenFeature([8, 8], tf.float32),
            "label": tf.io.FixedLenFeature([1], tf.int64),
        })
        features = {"image": r["image"] / 255.0}
        if mode == Mode.PREDICTION:
            return features
        return features, tf.cast(r["label"], tf.int32)

    return dataset.map(_parse_data)


def eval_metrics_fn():
    return {"accuracy": tf.keras.metrics.SparseCategoricalAccuracy()}
