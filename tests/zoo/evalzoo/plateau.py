"""A model that stops improving after epoch 2, whatever the workers' timing: y = w * x on
x = y = 1, w from 0, plain SGD (no momentum) whose learning rate drops to 1e-9 at epoch 3
(a rate of 0 would stop it outright; 1e-9 leaves a trace of improvement below min_delta).

Each step moves w a tenth of the way to 1, so the validation error falls by more than 0.1 in
epochs 1 and 2 and by less than 1e-8 after: with min_delta 1e-4, EarlyStopping(patience=2)
must end the job after epoch 4.
"""

import os

import keras
import tensorflow as tf

from elasticdl import Mode
from elasticdl.callbacks import EarlyStopping, LearningRateScheduler, ModelCheckpoint

OUT = os.environ.get("EVALZOO_OUT", "out")
LEARNING_RATE = 0.05


def custom_model():
    inputs = keras.Input(shape=(1,), name="x")
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="w")(inputs)
    return keras.Model(inputs, outputs)


def loss(labels, predictions):
    return tf.reduce_mean(tf.square(labels - predictions))


def optimizer():
    return keras.optimizers.SGD(learning_rate=LEARNING_RATE)


def dataset_fn(dataset, mode, metadata):
    def parse(line):
        x = tf.reshape(tf.strings.to_number(line, tf.float32), [1])
        return x if mode == Mode.PREDICTION else (x, x)

    return dataset.map(parse)


def eval_metrics_fn():
    return {"mse": keras.metrics.MeanSquaredError()}


def callbacks():
    return [
        LearningRateScheduler(lambda epoch: LEARNING_RATE if epoch < 2 else 1e-9, by="epoch"),
        EarlyStopping(monitor="mse", patience=2, min_delta=1e-4),
        ModelCheckpoint(os.path.join(OUT, "best-{version}"), monitor="mse"),
    ]
