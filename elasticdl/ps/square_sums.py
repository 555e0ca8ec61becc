"""One BLAS pass that answers a PS's checks of a dense gradient (finite? how large?).

Before it applies a push the PS asks of each dense gradient whether every value is finite
(``ParameterShard.check_gradients``), its L2 norm and whether any value is beyond what float32
arithmetic takes (``GradientGuard``). Asked one by one, that was ``isfinite`` (a pass and a
bool temporary), ``max(abs(g))`` (an array-sized temporary, then a pass) and a dot: 7-8 ms per
20 MB, more than the update itself (docs/benchmarks.md). The float32 dot of a gradient with
itself answers all three at once in 0.5 ms: the square of a NaN or an infinity is NaN or
infinite, and a float32 sum of squares (rounded monotonically, every term >= 0) is at least its
largest term. So a finite sum at most ``SAFE_SQUARE_SUM`` proves every value finite and below
the float32 square limit; only a gradient it does not clear is looked at value by value.

Example::

    cleared_square_sum(np.ones(4, np.float32))  # 4.0
    cleared_square_sum(np.array([np.nan], np.float32))  # None: look closer
"""

from __future__ import annotations

import math

import numpy as np

# Below float32's largest value (3.4e38) with a margin for the sum's rounding: a sum up to this
# holds no term whose square overflowed (|g| <= 1e19 < sqrt(3.4e38) = 1.8e19).
SAFE_SQUARE_SUM = 1e38


def square_sum(array: np.ndarray) -> float:
    """The sum of the squares of ``array``'s values, in float32 as BLAS sums them (one pass)."""
    flat = np.ravel(array)
    if flat.size == 0:
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(flat, flat))


def cleared_square_sum(array: np.ndarray) -> float | None:
    """``square_sum(array)`` when it proves every value finite with a square float32 holds
    (then no value exceeds its square root); None when the values must be checked one by one."""
    total = square_sum(array)
    return total if math.isfinite(total) and total <= SAFE_SQUARE_SUM else None
