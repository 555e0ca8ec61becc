"""Digits as raw pixels (0..255) through Dense -> BatchNormalization -> ReLU -> Dense.

Nothing scales the inputs before the BatchNormalization: at inference it subtracts its moving
mean (in the hundreds here) and divides by its moving variance, so a model whose moving
statistics never trained (0 and 1) predicts far worse than the one ``model.fit`` gives.
Momentum 0.9 instead of Keras's 0.99: a few dozen updates make the statistics, so that both the
short ``model.fit`` and the ElasticDL job (one update per sync version) end with trained ones.
"""

import keras
import tensorflow as tf

from elasticdl import Mode

_FEATURES = {
    "image": tf.io.FixedLenFeature([64], tf.float32),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}


def custom_model():
    inputs = keras.Input(shape=(64,), name="image")
    x = keras.layers.Dense(64, use_bias=False, name="hidden")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9, name="bn")(x)
    x = keras.layers.ReLU()(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_bn")


def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))


def optimizer():
    return keras.optimizers.Adam(learning_rate=0.01)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        if mode == Mode.PREDICTION:
            return example["image"]
        return example["image"], example["label"]

    dataset = dataset.map(parse)
    if mode == Mode.TRAINING:
        dataset = dataset.shuffle(512, seed=0)
    return dataset


def eval_metrics_fn():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}
