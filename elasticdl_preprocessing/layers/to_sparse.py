"""ToSparse: a dense tensor to a ``tf.SparseTensor`` without its padding cells."""

from __future__ import annotations

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer


class ToSparse(PreprocessingLayer):
    """Keeps the cells that differ from ``ignore_value`` as a ``tf.SparseTensor`` of the input's
    dense shape; a ``tf.SparseTensor`` input is returned as it is. Without ``ignore_value`` the
    padding is ``""`` for strings and ``-1`` for integers (the original's defaults; 0 stays, it
    is an id), and nothing is dropped from floats.

    >>> ToSparse()([["A", ""], ["B", "C"]])  # indices [[0, 0], [1, 0], [1, 1]], values [A, B, C]
    """

    def __init__(self, ignore_value=None, **kwargs):
        super().__init__(**kwargs)
        self.ignore_value = ignore_value

    def call(self, inputs):
        if isinstance(inputs, tf.SparseTensor):
            return inputs
        if isinstance(inputs, tf.RaggedTensor):
            return inputs.to_sparse()
        inputs = tf.convert_to_tensor(inputs)
        ignore = self.ignore_value
        if ignore is None:
            if inputs.dtype == tf.string:
                ignore = ""
            elif inputs.dtype.is_integer:
                ignore = -1
            else:  # floats have no padding value of their own: keep every cell
                return _all_cells(inputs)
        keep = tf.where(tf.not_equal(inputs, tf.constant(ignore, inputs.dtype)))
        return tf.SparseTensor(keep, tf.gather_nd(inputs, keep), tf.shape(inputs, out_type=tf.int64))

    def get_config(self) -> dict:
        return {**super().get_config(), "ignore_value": self.ignore_value}


def _all_cells(inputs: tf.Tensor) -> tf.SparseTensor:
    keep = tf.where(tf.ones_like(inputs, dtype=tf.bool))
    return tf.SparseTensor(keep, tf.gather_nd(inputs, keep), tf.shape(inputs, out_type=tf.int64))
