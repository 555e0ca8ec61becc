"""How a PS turns pushed gradients into model versions.

``DirectUpdatingStrategy`` applies each gradient at once (async SGD).
``AverageUpdatingStrategy`` gathers ``grads_to_wait`` gradients computed on the current
version, averages them and applies once (sync SGD); a gradient computed on an older
version is rejected so the worker re-pulls and recomputes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from elasticdl.ps.parameters import ParameterShard


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    version: int  # the shard's version after the push
    reason: str = ""


class GradientUpdatingStrategy(ABC):
    @abstractmethod
    def push(
        self,
        shard: ParameterShard,
        grads: dict[str, np.ndarray],
        version: int,
        learning_rate: float | None,
    ) -> PushResult:
        """Take one worker's gradients (already checked by ``shard.check_gradients``)."""


class DirectUpdatingStrategy(GradientUpdatingStrategy):
    def push(self, shard, grads, version, learning_rate):
        shard.apply(grads, learning_rate)
        return PushResult(True, shard.version)


class AverageUpdatingStrategy(GradientUpdatingStrategy):
    def __init__(self, grads_to_wait: int):
        if grads_to_wait < 1:
            raise ValueError(f"grads_to_wait must be at least 1. Received: {grads_to_wait}")
        self.grads_to_wait = grads_to_wait
        self._sums: dict[str, np.ndarray] = {}
        self._count = 0

    def push(self, shard, grads, version, learning_rate):
        if version != shard.version:
            return PushResult(
                False,
                shard.version,
                f"stale gradient: computed on version {version}, the model is at {shard.version}",
            )
        for name, grad in grads.items():
            acc = self._sums.get(name)
            if acc is None:
                self._sums[name] = np.array(grad, dtype=np.float32)
            else:
                acc += grad
        self._count += 1
        if self._count >= self.grads_to_wait:
            scale = np.float32(1.0 / self._count)
            for acc in self._sums.values():
                acc *= scale
            shard.apply(self._sums, learning_rate)
            self._sums = {}
            self._count = 0
        return PushResult(True, shard.version)
