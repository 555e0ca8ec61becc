"""ConcatenateWithOffset: several id tensors into one id space, each shifted by its offset."""

from __future__ import annotations

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer


class ConcatenateWithOffset(PreprocessingLayer):
    """Adds ``offsets[i]`` to the i-th input and concatenates the results along ``axis``, so that
    the ids of several features (each from 0 to its own size) share one embedding table without
    colliding. The inputs are all dense, all ``tf.SparseTensor`` or all ``tf.RaggedTensor``.

    >>> ConcatenateWithOffset(offsets=[0, 10], axis=1)([[[1], [1]], [[2], [2]]])  # [[1, 12], [1, 12]]
    """

    def __init__(self, offsets, axis: int = -1, **kwargs):
        super().__init__(**kwargs)
        self.offsets = [int(o) for o in offsets]
        self.axis = axis

    def call(self, inputs):
        inputs = list(inputs)
        if len(inputs) != len(self.offsets):
            raise ValueError(f"ConcatenateWithOffset: {len(inputs)} inputs but {len(self.offsets)} offsets: "
                             "pass one offset per input")
        shifted = [self._shift(tensor, offset) for tensor, offset in zip(inputs, self.offsets)]
        if isinstance(shifted[0], tf.SparseTensor):
            return tf.sparse.concat(axis=self.axis, sp_inputs=shifted)
        return tf.concat(shifted, axis=self.axis)

    @staticmethod
    def _shift(tensor, offset: int):
        if isinstance(tensor, tf.SparseTensor):
            return tensor.with_values(tensor.values + tf.cast(offset, tensor.values.dtype))
        if not isinstance(tensor, tf.RaggedTensor):
            tensor = tf.convert_to_tensor(tensor)
        return tensor + tf.cast(offset, tensor.dtype)

    def compute_output_shape(self, input_shape):
        shapes = [list(s) for s in input_shape]
        out = shapes[0]
        axis = self.axis % len(out)
        sizes = [s[axis] for s in shapes]
        out[axis] = None if any(s is None for s in sizes) else sum(sizes)
        return tuple(out)

    def get_config(self) -> dict:
        return {**super().get_config(), "offsets": list(self.offsets), "axis": self.axis}
