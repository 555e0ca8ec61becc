"""A wide dense MLP for the training benchmark (about 5M parameters with the defaults).

    input_dim=768, width=1024, depth=5, classes=10:
    768*1024 + 4*1024*1024 + 1024*10 weights + biases = 4,996,106 parameters

Records are tf.train.Example with ``x`` (input_dim floats) and ``label`` (int64), as
written by ``benchmarks/data.py``.
"""

import keras
import tensorflow as tf

from elasticdl.mode import Mode

INPUT_DIM = 768


def custom_model(input_dim=INPUT_DIM, width=1024, depth=5, classes=10):
    inputs = keras.Input(shape=(input_dim,), name="x")
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="dense_mlp")


def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer(lr=0.01):
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def dataset_fn(dataset, mode, metadata):
    features = {
        "x": tf.io.FixedLenFeature([_input_dim()], tf.float32),
        "label": tf.io.FixedLenFeature([1], tf.int64),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        if mode == Mode.PREDICTION:
            return example["x"]
        return example["x"], example["label"]

    return dataset.map(parse)


def _input_dim():
    # dataset_fn has no access to model_params; the quick benchmark writes narrower
    # records and says so through this variable (inherited by the workers).
    import os

    return int(os.environ.get("BENCH_DENSE_INPUT_DIM", INPUT_DIM))
