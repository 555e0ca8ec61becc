"""A model with two outputs and Keras's compile(loss_weights=...) written as docs/model_zoo.md
("Several outputs: loss weights") says."""

import keras
import tensorflow as tf

LOSS_WEIGHTS = {"ctr": 1.0, "cvr": 0.5}  # compile(loss_weights=...)


def custom_model():
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, {"ctr": keras.layers.Dense(1, activation="sigmoid", name="ctr")(hidden),
                                "cvr": keras.layers.Dense(1, activation="sigmoid", name="cvr")(hidden)})


def loss(labels, predictions):
    per_output = {
        "ctr": keras.losses.binary_crossentropy(labels["ctr"], predictions["ctr"]),
        "cvr": keras.losses.binary_crossentropy(labels["cvr"], predictions["cvr"]),
    }
    return tf.add_n([weight * per_output[name] for name, weight in LOSS_WEIGHTS.items()])


def optimizer(lr=0.1):
    return keras.optimizers.SGD(learning_rate=lr)


def dataset_fn(dataset, mode, metadata):
    raise NotImplementedError("the loss-weight tests feed batches directly")
