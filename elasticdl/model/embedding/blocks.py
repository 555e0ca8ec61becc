"""A gathered block of table rows (row, then each optimizer slot) split into contiguous parts.

The table stores a row and its slots side by side (``[n, dim x (1 + slots)]``) so that an
update gathers each row once. The optimizer's ufuncs on column views of that block run one
inner loop per row, ``dim`` floats long: Adam on 8,192 rows of 16 floats took 660 us through
the views, 180 us on contiguous arrays. Moving the block to ``[1 + slots, n, dim]`` and back
costs about 170 us (each row's parts move as opaque items of ``dim`` floats, one copy each),
so the split pays for itself. The arithmetic is the same, element by element: the results are
bit-identical to an update through the views.
"""

from __future__ import annotations

import numpy as np


def _items(block: np.ndarray, dim: int) -> np.ndarray:
    """``block`` [n, dim x k] as [n, k] opaque items of ``dim`` floats (a view)."""
    return block.view(np.dtype((np.void, 4 * dim)))


def by_part(block: np.ndarray, dim: int) -> np.ndarray:
    """float32 [k, n, dim]: part ``j`` is columns ``j*dim .. (j+1)*dim`` of every row (a copy).

    ``block``: float32 [n, dim x k], C order."""
    rows, width = block.shape
    if width == dim:
        return block.reshape(1, rows, dim)  # the row alone: already one contiguous part
    items = _items(block, dim)
    parts = np.empty((width // dim, rows), items.dtype)
    np.copyto(parts, items.T)
    return parts.view(np.float32).reshape(width // dim, rows, dim)


def by_row(parts: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The inverse of ``by_part``, written into ``out`` (float32 [n, dim x k]); returns ``out``."""
    count, rows, dim = parts.shape
    if count == 1:
        if not np.shares_memory(parts, out):
            out[...] = parts[0]
        return out
    np.copyto(_items(out, dim).T, parts.reshape(count, rows * dim).view(np.dtype((np.void, 4 * dim))))
    return out
