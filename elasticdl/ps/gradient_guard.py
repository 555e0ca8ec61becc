"""The gradient guard: a PS refuses a gradient that would wreck its shard, and counts it.

One finite gradient of 1e38 passes every check of shape, dtype and NaN, and turns the model
into noise in one apply (the job then "succeeds" at chance accuracy). So, before a push is
applied, the PS measures its gradient (the L2 norm over the push's dense gradients and
embedding rows) and refuses it when

- a value lies beyond what float32 arithmetic takes (its square, which Adam and Adagrad keep,
  overflows float32: ``|g| > FLOAT32_SQUARE_LIMIT``), or the norm itself is not finite; or
- ``max_norm_ratio`` > 0 (``--max_gradient_norm_ratio``) and the norm is more than that many
  times the running norm of the gradients this PS applied (an exponential moving average,
  once ``warmup`` pushes made it meaningful).

A refused gradient is never applied and never moves the running norm. The PS counts it
(``refused``, in its stats; the master's report names the total, ``gradients_refused``).

Pure Python (numpy): the ParameterServer calls it under its lock.

Example::

    guard = GradientGuard(max_norm_ratio=1000)
    guard.problem({"w": np.full(4, 1e38, np.float32)})  # '... beyond float32 ...'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.ps.square_sums import cleared_square_sum, square_sum

# Above this a value's square overflows float32 (sqrt(3.4e38)): an optimizer's slots go to inf.
FLOAT32_SQUARE_LIMIT = math.sqrt(float(np.finfo(np.float32).max))
DEFAULT_MAX_NORM_RATIO = 1000.0  # --max_gradient_norm_ratio's default: only a gross outlier
DEFAULT_WARMUP = 10  # applied pushes before the running norm is trusted
_DECAY = 0.9  # weight of the running norm against a new gradient's


@dataclass
class GradientGuard:
    max_norm_ratio: float = DEFAULT_MAX_NORM_RATIO  # 0: no ratio check (the float32 check stays)
    warmup: int = DEFAULT_WARMUP
    running_norm: float = 0.0
    applied: int = 0  # gradients measured and let through
    refused: int = 0
    last_refusal: str = ""
    _measured: float = 0.0  # the norm of the gradient checked last

    def problem(self, grads: dict) -> str:
        """Why ``grads`` must not be applied ('' when they may). A refusal is counted."""
        norm, largest = _measure(grads)
        self._measured = norm
        problem = ""
        if not math.isfinite(norm) or largest > FLOAT32_SQUARE_LIMIT:
            problem = (f"gradient refused: a value of magnitude {largest:.3g} is beyond what float32 arithmetic "
                       f"takes (above {FLOAT32_SQUARE_LIMIT:.3g}, its square overflows); the model is left intact")
        elif (self.max_norm_ratio > 0 and self.applied >= self.warmup and self.running_norm > 0
              and norm > self.max_norm_ratio * self.running_norm):
            problem = (f"gradient refused: its norm {norm:.3g} is {norm / self.running_norm:.3g} times the running "
                       f"norm {self.running_norm:.3g}, beyond --max_gradient_norm_ratio {self.max_norm_ratio:g} "
                       "(0 disables the check)")
        if problem:
            self.refused += 1
            self.last_refusal = problem
        return problem

    def passed(self) -> None:
        """The gradient checked last was taken: it moves the running norm."""
        norm = self._measured
        self.running_norm = norm if self.applied == 0 else _DECAY * self.running_norm + (1 - _DECAY) * norm
        self.applied += 1


def _measure(grads: dict) -> tuple[float, float]:
    """(L2 norm, largest magnitude) of the gradients. Summed in their own float32 (no copy of a
    large gradient): a sum that overflows is a norm beyond 1.8e19, refused all the same. For a
    gradient whose sum of squares clears it (ps/square_sums.py) the largest magnitude is that
    sum's root, a bound: exact values are needed only where one may be beyond float32."""
    total, largest = 0.0, 0.0
    for value in grads.values():
        if isinstance(value, NonTrainableChange):
            continue  # new values of state, not gradients
        array = value.values if isinstance(value, IndexedRows) else value
        cleared = cleared_square_sum(array)
        if cleared is not None:  # no value above its root, so none beyond float32 (ps/square_sums.py)
            largest, total = max(largest, math.sqrt(cleared)), total + cleared
            continue
        flat = np.ravel(array)
        if flat.size == 0:
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            largest = max(largest, float(np.max(np.abs(flat))))
        total += square_sum(flat)
    return math.sqrt(total), largest
