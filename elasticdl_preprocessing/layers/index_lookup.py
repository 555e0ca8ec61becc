"""IndexLookup: a string to its index in a fixed vocabulary."""

from __future__ import annotations

import collections

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer, map_values


class IndexLookup(PreprocessingLayer):
    """Maps each string to its position in ``vocabulary`` (a list, or a text file of one term a
    line); a string not in it to ``len(vocabulary) + hash % num_oov_tokens`` (one OOV id by
    default; with ``num_oov_tokens=0``, -1). The ids are int64, in the input's structure (dense,
    sparse or ragged). The table is built from the vocabulary when the layer is made, so every
    worker and the exported model hold the same one.

    >>> IndexLookup(vocabulary=["A", "B", "C"])([["A"], ["B"], ["C"], ["D"], ["E"]])  # [[0], [1], [2], [3], [3]]
    """

    def __init__(self, vocabulary=None, num_oov_tokens: int = 1, **kwargs):
        super().__init__(**kwargs)
        if isinstance(vocabulary, str):
            vocabulary = _read_vocabulary(vocabulary)
        if not vocabulary:
            raise ValueError("IndexLookup: `vocabulary` must name at least one term (a list, or a file of one "
                             f"term a line). Received: vocabulary={vocabulary!r}")
        repeated = sorted(t for t, n in collections.Counter(vocabulary).items() if n > 1)
        if repeated:
            raise ValueError(f"IndexLookup: the vocabulary repeats {repeated}: give each term once")
        if num_oov_tokens < 0:
            raise ValueError(f"IndexLookup: `num_oov_tokens` cannot be negative. Received: {num_oov_tokens}")
        self.vocabulary = [str(t) for t in vocabulary]
        self.num_oov_tokens = int(num_oov_tokens)
        keys = tf.constant(self.vocabulary)
        initializer = tf.lookup.KeyValueTensorInitializer(keys, tf.range(len(self.vocabulary), dtype=tf.int64))
        if self.num_oov_tokens:
            self.table = tf.lookup.StaticVocabularyTable(initializer, num_oov_buckets=self.num_oov_tokens)
        else:
            self.table = tf.lookup.StaticHashTable(initializer, default_value=-1)

    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def call(self, inputs):
        return map_values(self._lookup, inputs)

    def _lookup(self, values: tf.Tensor) -> tf.Tensor:
        if values.dtype != tf.string:
            values = tf.strings.as_string(values)
        return tf.cast(self.table.lookup(values), tf.int64)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "vocabulary": list(self.vocabulary), "num_oov_tokens": self.num_oov_tokens}


def _read_vocabulary(path: str) -> list[str]:
    with tf.io.gfile.GFile(path, "r") as f:
        return [line.strip() for line in f if line.strip()]
