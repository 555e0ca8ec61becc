"""Arrays whose bytes start on a 64-byte boundary, so TensorFlow can take them without a copy.

TensorFlow (Eigen) wants a tensor's buffer aligned to 64 bytes. numpy's allocator gives 16, so
converting a received numpy array to a tensor copied it (4 ms per 20 MB on the worker's
critical path, docs/benchmarks.md), and DLPack, which does not copy, aborts the process on an
unaligned buffer. The transports receive every multi-piece tensor into an array made here
(rpc/codec.py, rpc/bulk.py); the worker hands such arrays to its variables through DLPack
(model/variable_assign.py) and copies only the others. Alignment is met by construction, and
checked again where it matters (``is_aligned``).

Example::

    array = aligned_empty((1024, 1024), np.float32)
    is_aligned(array)  # True
"""

from __future__ import annotations

import math

import numpy as np

ALIGNMENT = 64  # bytes: Eigen's largest (AVX-512) alignment


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` whose data starts on an ALIGNMENT boundary
    (an empty one has no bytes to align)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(dim) for dim in shape)
    if any(dim < 0 for dim in shape):  # as np.empty: a negative dimension is no shape
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    # Python ints: an int64 product would wrap around for a forged shape and allocate too little.
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(array: np.ndarray) -> bool:
    """True for a C-contiguous array whose data starts on an ALIGNMENT boundary."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0
