"""What every layer of this package shares: it takes ids, strings and numbers as they come (no
cast to the layer's float dtype), from tensors or arrays, and maps the values of a dense, sparse
or ragged tensor while keeping its structure (the sparse indices, the ragged row lengths)."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf


class PreprocessingLayer(tf.keras.layers.Layer):
    """A layer whose inputs keep their dtype. ``tf.keras`` is tf_keras under TF_USE_LEGACY_KERAS=1,
    else Keras 3: the layers subclass the Keras the model that uses them is written in."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Keras 3 would cast every input to the layer's float dtype, and refuse numpy arrays as
        # positional arguments; tf_keras ignores both attributes.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True


def map_values(fn: Callable[[tf.Tensor], tf.Tensor], inputs):
    """``fn`` applied to the values of ``inputs``, returned in the structure ``inputs`` had."""
    if isinstance(inputs, tf.RaggedTensor):
        return tf.ragged.map_flat_values(fn, inputs)
    if isinstance(inputs, tf.SparseTensor):
        return inputs.with_values(fn(inputs.values))
    return fn(tf.convert_to_tensor(inputs))
