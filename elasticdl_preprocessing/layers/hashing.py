"""Hashing: a categorical value to one of ``num_bins`` ids by a stable string hash."""

from __future__ import annotations

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer, map_values


class Hashing(PreprocessingLayer):
    """Maps every value to ``Fingerprint64(str(value)) % num_bins`` (TensorFlow's
    ``tf.strings.to_hash_bucket_fast``), as the original's layer documents: integers are hashed
    as their decimal strings, so ``7`` and ``"7"`` share an id. The ids are int64, in the
    input's structure (a dense, ``tf.SparseTensor`` or ``tf.RaggedTensor`` input keeps it).

    >>> Hashing(num_bins=3)([["A"], ["B"], ["C"], ["D"], ["E"]])  # [[1], [0], [1], [1], [2]]
    """

    def __init__(self, num_bins: int, **kwargs):
        if num_bins is None or int(num_bins) <= 0:
            raise ValueError(f"Hashing: `num_bins` must be a positive integer. Received: num_bins={num_bins}")
        super().__init__(**kwargs)
        self.num_bins = int(num_bins)

    def call(self, inputs):
        return map_values(self._hash, inputs)

    def _hash(self, values: tf.Tensor) -> tf.Tensor:
        if values.dtype != tf.string:
            values = tf.strings.as_string(values)
        return tf.strings.to_hash_bucket_fast(values, self.num_bins)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "num_bins": self.num_bins}
