"""Pulled parameters into the worker's variables with one copy less.

``tf.Variable.assign`` of a numpy array converts it to a tensor first: a copy (4 ms per 20 MB,
half of what writing a pulled dense model into the variables cost; docs/benchmarks.md). An
array received into an aligned buffer (model/aligned_arrays.py) goes to the variable through
DLPack instead: the variable takes the array's buffer as its value, no byte is copied, and the
array stays alive as long as the variable holds it. TensorFlow never writes into it (an update
of the variable copies first: the buffer is shared), and the worker never writes into a pulled
array after assigning it. Any other array (read-only views of a message, unaligned, another
dtype, empty) is assigned as before.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from elasticdl.model.aligned_arrays import is_aligned


def assign(variable: tf.Variable, value: np.ndarray) -> None:
    """``variable.assign(value)``, without converting ``value`` through a copy when it can be shared."""
    dtype = variable.dtype.as_numpy_dtype
    if shareable(value, dtype):
        variable.assign(tf.experimental.dlpack.from_dlpack(value.__dlpack__()))
        return
    variable.assign(np.asarray(value, dtype=dtype))


def shareable(value, dtype) -> bool:
    """Whether TensorFlow can take ``value``'s buffer as it is (DLPack: writable, aligned, non-empty)."""
    return (isinstance(value, np.ndarray) and value.dtype == dtype and value.size > 0
            and value.flags.writeable and is_aligned(value))
