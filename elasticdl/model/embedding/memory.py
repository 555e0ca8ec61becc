"""Table arrays in their own memory mappings: grown in place, and given back to the kernel.

A PS runs with glibc told to keep freed memory in its heap (``MALLOC_MMAP_THRESHOLD_``,
launch/api.py's ROLE_ENV: it doubles the data plane). A table that grew by doubling through
the heap would keep every outgrown copy resident: its RSS would be about twice its rows. The
arrays here live in anonymous mappings instead:

- ``MappedArray`` grows by ``mremap`` (the kernel moves the pages: no copy, and no page faults
  on the rows already there); pages past the rows written are never resident, so a doubled
  block costs what it holds;
- ``prefault`` faults in the range about to be written in one call (MADV_POPULATE_WRITE): one
  page fault per 4 KiB, taken one by one, was a fifth of the time spent creating rows;
- a dropped array's mapping goes back to the kernel at once;
- a mapping of 2 MiB or more asks for transparent huge pages (``_mapping``): fewer TLB misses
  on the random row reads of a large table.
"""

from __future__ import annotations

import mmap

import numpy as np

# Private: a shared anonymous mapping is a shmem file that mremap does not grow (SIGBUS past
# its first size).
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_HUGE_PAGE = 2 << 20  # smaller mappings stay in 4 KiB pages: a huge page would be mostly empty
_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14); older kernels refuse it: then pages fault as usual


def _mapping(nbytes: int) -> mmap.mmap:
    """An anonymous mapping backed by huge pages where the kernel has them (transparent huge
    pages, "madvise" or "always"): rows are read at random, and with 4 KiB pages nearly every
    row of a large table costs a TLB miss too (a gather plus scatter of 8,192 random rows of
    192 bytes from a million: 0.73 against 0.54 ms). A mapping keeps the advice through
    mremap, and gets it when it grows past a huge page. The resident cost stays the rows
    written, rounded up to a 2 MiB page."""
    mapped = mmap.mmap(-1, nbytes, flags=_FLAGS)
    _advise_huge(mapped)
    return mapped


def _advise_huge(mapped: mmap.mmap) -> None:
    if len(mapped) >= _HUGE_PAGE:
        try:
            mapped.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError, ValueError):
            pass  # no transparent huge pages: 4 KiB pages, as without the advice


class MappedArray:
    """An array of ``capacity`` rows (each ``row_shape``) in its own mapping, resizable in place.

    ``resized`` needs every view of the current array dropped first (the mapping cannot move
    under a live view): the owner sets its attribute to None, then takes the new array. A view
    still alive elsewhere makes it fall back to a copy into a new mapping.
    """

    def __init__(self, capacity: int, row_shape: tuple[int, ...], dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.row_shape = row_shape
        self.row_bytes = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        self._map = _mapping(max(capacity * self.row_bytes, mmap.PAGESIZE))
        self.capacity = capacity

    def array(self) -> np.ndarray:
        count = self.capacity * self.row_bytes // self.dtype.itemsize
        return np.frombuffer(self._map, self.dtype, count=count).reshape((self.capacity, *self.row_shape))

    def resized(self, capacity: int) -> np.ndarray:
        """The array with ``capacity`` rows, the first rows kept (drop your views first)."""
        nbytes = max(capacity * self.row_bytes, mmap.PAGESIZE)
        try:
            small = len(self._map) < _HUGE_PAGE
            self._map.resize(nbytes)
            if small:
                _advise_huge(self._map)
        except BufferError:  # a view of the old rows is alive: copy them into a new mapping
            fresh = _mapping(nbytes)
            keep = min(len(self._map), nbytes)
            np.frombuffer(fresh, np.uint8, count=keep)[:] = np.frombuffer(self._map, np.uint8, count=keep)
            self._map = fresh
        self.capacity = capacity
        return self.array()

    def prefault(self, start: int, end: int) -> None:
        """Fault in rows [start, end) at once: they are about to be written."""
        lo = start * self.row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(end * self.row_bytes, len(self._map))
        if hi > lo:
            try:
                self._map.madvise(_POPULATE_WRITE, lo, hi - lo)
            except (OSError, ValueError):
                pass  # an older kernel: the writes fault the pages in one by one, as without it
