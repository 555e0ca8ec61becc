"""Large table arrays whose memory goes back to the kernel when they are dropped.

A PS runs with glibc told to keep freed memory in its heap (``MALLOC_MMAP_THRESHOLD_``,
launch/api.py's ROLE_ENV: it doubles the data plane). A table that grows by doubling would
then keep every outgrown copy resident: its RSS would be about twice its rows. Arrays made
here live in their own anonymous mapping instead: the kernel takes it back when the array is
dropped, and pages not written yet (the unused half of a doubled block) are never resident.
"""

from __future__ import annotations

import mmap

import numpy as np

# Below this an array comes from the heap as usual: a mapping costs a system call and a page.
MAPPED_BYTES = 1 << 20


def allocate(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array (zero pages when mapped; write before reading either way)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MAPPED_BYTES:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def grown(array: np.ndarray, capacity: int, used: int) -> np.ndarray:
    """A copy of ``array`` with ``capacity`` rows; the first ``used`` rows carried over."""
    out = allocate((capacity, *array.shape[1:]), array.dtype)
    out[:used] = array[:used]
    return out
