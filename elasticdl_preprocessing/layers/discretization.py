"""Discretization: a number to the index of the bin it falls in, between fixed boundaries."""

from __future__ import annotations

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer, map_values


class Discretization(PreprocessingLayer):
    """Buckets numbers by the boundaries ``bins``: a bin includes its left boundary and excludes
    its right one, so ``bins=[0., 1., 2.]`` makes ``(-inf, 0)``, ``[0, 1)``, ``[1, 2)`` and
    ``[2, inf)``, ids 0 to 3 (``numpy.digitize(x, bins)``; a repeated boundary makes an empty
    bin, as there). The ids are int64, in the input's structure (dense, sparse or ragged).

    >>> Discretization(bins=[0.0, 1.0, 2.0])([[-1.5], [1.0], [3.0]])  # [[0], [2], [3]]
    """

    def __init__(self, bins, **kwargs):
        bins = [float(b) for b in bins]
        if any(b > a for a, b in zip(bins[1:], bins)):
            raise ValueError(f"Discretization: `bins` must be sorted in increasing order. Received: bins={bins}")
        super().__init__(**kwargs)
        self.bins = bins

    def num_bins(self) -> int:
        """How many ids the layer makes: ``len(bins) + 1`` (a method, as the original's)."""
        return len(self.bins) + 1

    def call(self, inputs):
        return map_values(self._bucketize, inputs)

    def _bucketize(self, values: tf.Tensor) -> tf.Tensor:
        if not (values.dtype.is_floating or values.dtype.is_integer):
            raise TypeError(f"Discretization takes numbers. Received a tensor of dtype {values.dtype.name}: "
                            "convert it first (tf.strings.to_number)")
        if values.dtype not in (tf.int32, tf.int64, tf.float32, tf.float64):  # what Bucketize takes
            values = tf.cast(values, tf.float64)
        return tf.cast(tf.raw_ops.Bucketize(input=values, boundaries=self.bins), tf.int64)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "bins": list(self.bins)}
