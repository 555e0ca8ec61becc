"""Digits with a subclassed Keras model (the same data contract as digits_functional)."""

import keras
from digits.digits_functional import dataset_fn, eval_metrics_fn, loss  # noqa: F401


class CustomModel(keras.Model):
    def __init__(self, hidden_units=64):
        super().__init__(name="digits_subclass")
        self.hidden = keras.layers.Dense(hidden_units, activation="relu", name="hidden")
        self.logits = keras.layers.Dense(10, name="logits")

    def call(self, inputs, training=False):
        return self.logits(self.hidden(inputs))


def optimizer(lr=0.01):
    return keras.optimizers.Adam(learning_rate=lr)

