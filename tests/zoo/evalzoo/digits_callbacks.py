"""A digits model for the evaluation/callback tests: metrics of both kinds and callbacks."""

import json
import os

import keras
import tensorflow as tf

from elasticdl import Mode
from elasticdl.callbacks import EarlyStopping, ModelCheckpoint, SavedModelExporter

_FEATURES = {
    "image": tf.io.FixedLenFeature([64], tf.float32),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}
OUT = os.environ.get("EVALZOO_OUT", "out")


def custom_model():
    inputs = keras.Input(shape=(64,), name="image")
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(hidden))


def loss(labels, predictions):
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(tf.reshape(labels, [-1]), predictions, from_logits=True)
    )


def optimizer(lr=0.1):
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        image = example["image"]
        if mode == Mode.PREDICTION:
            return image
        return image, example["label"]

    return dataset.map(parse)


def _correct(labels, predictions):
    return tf.cast(tf.equal(tf.reshape(labels, [-1]), tf.argmax(predictions, axis=1)), tf.float32)


def eval_metrics_fn():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(), "fn_accuracy": _correct}


class RecordEpochs(keras.callbacks.Callback):
    """A plain Keras callback: writes what the master passes it."""

    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append(["train_begin"])

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(["epoch_end", epoch, dict(logs or {})])

    def on_train_end(self, logs=None):
        self.events.append(["train_end"])
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "callback_events.json"), "w") as f:
            json.dump(self.events, f)


def callbacks():
    return [
        RecordEpochs(),
        # Accuracy can never improve by 1.0: the job stops after patience + 1 epochs.
        EarlyStopping(monitor="accuracy", min_delta=1.0, patience=1),
        ModelCheckpoint(os.path.join(OUT, "best"), monitor="accuracy"),
        SavedModelExporter(os.path.join(OUT, "exported")),
    ]


class PredictionOutputsProcessor:
    def __init__(self):
        self.path = os.path.join(OUT, f"processed-{os.getpid()}.txt")

    def process(self, predictions, worker_id):
        os.makedirs(OUT, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(f"{worker_id} {len(predictions)}\n")
