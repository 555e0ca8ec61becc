"""Normalizer: ``(x - subtractor) / divisor`` with statistics given up front (no adapt())."""

from __future__ import annotations

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer, map_values


class Normalizer(PreprocessingLayer):
    """Standardizes numbers with fixed statistics: ``(x - subtractor) / divisor`` in float32,
    in the input's structure (dense, sparse or ragged). The statistics are constants of the
    model, so every worker and the exported model use the same ones.

    >>> Normalizer(subtractor=1.0, divisor=2.0)([[3.0], [5.0], [7.0]])  # [[1.], [2.], [3.]]
    """

    def __init__(self, subtractor: float, divisor: float, **kwargs):
        if float(divisor) == 0.0:
            raise ValueError("Normalizer: `divisor` cannot be 0 (it divides every value): pass the feature's "
                             f"standard deviation, or 1.0 to only subtract. Received: divisor={divisor}")
        super().__init__(**kwargs)
        self.subtractor = float(subtractor)
        self.divisor = float(divisor)

    def call(self, inputs):
        return map_values(self._normalize, inputs)

    def _normalize(self, values: tf.Tensor) -> tf.Tensor:
        return (tf.cast(values, tf.float32) - self.subtractor) / self.divisor

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "subtractor": self.subtractor, "divisor": self.divisor}
