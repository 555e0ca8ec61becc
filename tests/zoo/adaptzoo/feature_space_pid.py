"""A FeatureSpace adapted at import, on data that differs in every process (seeded from the pid),
as a keras-io structured-data example adapts it on whatever its process loaded.

``dataset_fn`` applies it (keras-io's ``ds.map(lambda x, y: (feature_space(x), y))``).
``custom_model`` (which a worker runs once it has the master's state, before it reads data)
writes what this process's FeatureSpace holds (the ``age`` bins, the ``city`` vocabulary,
the ``income`` mean) to ``$ADAPTZOO_STATE_DIR/<pid>.json``: every process that runs the job
must show the master's. It has an ``IntegerLookup`` of its own, adapted in it.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf
from keras.utils import FeatureSpace

from elasticdl import Mode

CITIES = 12
_rng = np.random.default_rng(os.getpid())
_sample = {
    "age": _rng.normal(40, 12, size=(300,)).astype("float32"),
    "city": np.array([f"city{i}" for i in _rng.integers(0, CITIES, size=300)]),
    "income": _rng.normal(50, 20, size=(300,)).astype("float32"),
}
feature_space = FeatureSpace(
    features={"age": FeatureSpace.float_discretized(num_bins=6), "city": "string_categorical",
              "income": "float_normalized"},
    output_mode="concat",
)
feature_space.adapt(tf.data.Dataset.from_tensor_slices(_sample).batch(100))

_FEATURES = {
    "age": tf.io.FixedLenFeature([], tf.float32),
    "city": tf.io.FixedLenFeature([], tf.string),
    "income": tf.io.FixedLenFeature([], tf.float32),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}


def _write_state():
    directory = os.environ.get("ADAPTZOO_STATE_DIR")
    if not directory:
        return
    income = feature_space.preprocessors["income"]
    state = {"age_bins": [float(b) for b in feature_space.preprocessors["age"].bin_boundaries],
             "cities": [str(c) for c in feature_space.preprocessors["city"].get_vocabulary()],
             "income_mean": float(np.asarray(income.mean).ravel()[0])}
    with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
        json.dump(state, f)


def custom_model():
    _write_state()
    kids = keras.layers.IntegerLookup(name="kids_lookup")
    kids.adapt(np.random.default_rng(os.getpid()).integers(0, 6, size=40))
    inputs = keras.Input(shape=(feature_space.get_encoded_features().shape[-1],), name="encoded")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="logits")(hidden)
    model = keras.Model(inputs, outputs, name="feature_space_pid")
    model.kids = kids  # an in-model lookup adapted in custom_model(): tracked, handed on too
    return model


def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))


def optimizer():
    return keras.optimizers.SGD(learning_rate=0.05)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        label = example.pop("label")
        features = feature_space(example)
        return features if mode == Mode.PREDICTION else (features, label)

    return dataset.map(parse)
