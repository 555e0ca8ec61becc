"""Digits (8x8 images, 10 classes): a functional Keras MLP for ElasticDL.

    elasticdl train --model_zoo model_zoo --model_def digits.digits_functional.custom_model \
        --training_data data/digits/train --validation_data data/digits/test
"""

import keras
import tensorflow as tf

from elasticdl import Mode

_FEATURES = {
    "image": tf.io.FixedLenFeature([64], tf.float32),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}


def custom_model(hidden_units=64, dropout=0.0):
    inputs = keras.Input(shape=(64,), name="image")
    x = keras.layers.Dense(hidden_units, activation="relu", name="hidden")(inputs)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_mlp")


def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer(lr=0.1):
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


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
    return {
        "accuracy": keras.metrics.SparseCategoricalAccuracy(),
    }
