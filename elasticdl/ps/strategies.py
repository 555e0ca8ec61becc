"""How a PS turns pushed gradients into model versions.

``DirectUpdatingStrategy`` applies each gradient at once (async SGD and stale-synchronous
parallel). ``AverageUpdatingStrategy`` gathers ``grads_to_wait`` gradients computed on
the current version (or up to ``version_tolerance`` versions older), averages them and
applies once (sync SGD); an older gradient is rejected, so the worker re-pulls and
recomputes. The master tells the PS how many workers hold a training task
(``set_live_workers``): with ``grads_to_wait`` 0 (FOLLOW_LIVE_WORKERS, the default) a
version waits for one gradient from each of them, so no worker computes on a version the
others moved past (with a fixed 1 and two workers, 36-53% of the pushes were refused as
stale: wasted computations); with a fixed ``grads_to_wait`` the PS averages over the live
workers when fewer than that hold a task, instead of waiting forever.

Staleness of a gradient = the PS version when it arrives - the version it was computed
on. With ``lr_staleness_modulation`` its learning rate is divided by max(1, staleness).

Embedding-row gradients (``IndexedRows``) are averaged like dense ones: the rows of all
pushes of a version are summed per id, then divided by the number of pushes.

Non-trainable changes (``NonTrainableChange``, elasticdl/model/non_trainable.py) ride with the
gradients: ``DirectUpdatingStrategy`` adds each as it comes; ``AverageUpdatingStrategy``
averages them like gradients (a push without one counts as 0) and adds the average, which is
the average of the workers' new values. Staleness never scales them: they are not steps of
the optimizer.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from elasticdl.model.embedding.table import IndexedRows, RowGradientSum
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.ps.parameters import ParameterShard
from elasticdl.rpc.push_outcome import PushOutcome

# Per-version telemetry kept for this many recent versions (totals are kept for all).
TELEMETRY_VERSIONS = 10_000

# Async: a gradient computed on a version ahead of the PS counts as fresh (the PS restarted
# from an older checkpoint while the worker held a newer model), up to this many versions
# ahead; further than that it was computed on no model this PS made and is refused as stale,
# so the worker pulls and computes it again. Sync refuses any version ahead the same way.
VERSION_AHEAD_MARGIN = 10_000

# grads_to_wait 0: one gradient per worker holding a training task, as the master counts them.
FOLLOW_LIVE_WORKERS = 0


@dataclass(frozen=True)
class PushResult:
    outcome: PushOutcome
    version: int  # the shard's version after the push
    reason: str = ""  # for people (logs, errors); decisions go by `outcome`

    @property
    def accepted(self) -> bool:
        return self.outcome.accepted

    @property
    def applied(self) -> bool:
        return self.outcome.applied


@dataclass
class VersionCounts:
    accepted: int = 0
    rejected_stale: int = 0


@dataclass
class UpdateTelemetry:
    """What staleness does to a job: counted on the PS, summarised by the master."""

    pushes_accepted: int = 0
    pushes_rejected_stale: int = 0
    pushes_rejected_invalid: int = 0
    staleness: collections.Counter = field(default_factory=collections.Counter)  # of applied grads
    per_version: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def _at(self, version: int) -> VersionCounts:
        counts = self.per_version.get(version)
        if counts is None:
            counts = self.per_version[version] = VersionCounts()
            while len(self.per_version) > TELEMETRY_VERSIONS:
                self.per_version.popitem(last=False)
        return counts

    def accepted(self, version: int, staleness: int) -> None:
        self.pushes_accepted += 1
        self.staleness[staleness] += 1
        self._at(version).accepted += 1

    def rejected_stale(self, version: int) -> None:
        self.pushes_rejected_stale += 1
        self._at(version).rejected_stale += 1


class GradientUpdatingStrategy(ABC):
    def __init__(self, lr_staleness_modulation: bool = False):
        self.lr_staleness_modulation = lr_staleness_modulation
        self.telemetry = UpdateTelemetry()

    @abstractmethod
    def push(
        self,
        shard: ParameterShard,
        grads: dict[str, np.ndarray],
        version: int,
        learning_rate: float | None,
    ) -> PushResult:
        """Take one worker's gradients (already checked by ``shard.check_gradients``)."""

    def set_live_workers(self, shard: ParameterShard, count: int) -> bool:
        """The number of workers holding a task changed; True if that applied an update."""
        return False

    @property
    def grads_to_wait(self) -> int:
        return 1

    @property
    def pending(self) -> int:
        """Gradients accepted and not applied yet (waiting in a sync average)."""
        return 0

    def _staleness_scale(self, staleness: int) -> float:
        return 1.0 / max(1, staleness) if self.lr_staleness_modulation else 1.0


class DirectUpdatingStrategy(GradientUpdatingStrategy):
    def push(self, shard, grads, version, learning_rate):
        if version > shard.version + VERSION_AHEAD_MARGIN:
            self.telemetry.rejected_stale(shard.version)
            return PushResult(
                PushOutcome.REJECTED_STALE,
                shard.version,
                f"gradient computed on version {version}, more than {VERSION_AHEAD_MARGIN} versions "
                f"ahead of this PS's {shard.version}: pull and compute it again",
            )
        # A version ahead of the PS (it restarted from an older checkpoint) counts as fresh.
        staleness = max(0, shard.version - version)
        scale = self._staleness_scale(staleness)
        if scale != 1.0:
            learning_rate = (shard.optimizer.learning_rate if learning_rate is None else learning_rate) * scale
        self.telemetry.accepted(shard.version, staleness)
        shard.apply(grads, learning_rate)
        return PushResult(PushOutcome.APPLIED, shard.version)


class AverageUpdatingStrategy(GradientUpdatingStrategy):
    def __init__(self, grads_to_wait: int, version_tolerance: int = 0, lr_staleness_modulation: bool = False):
        super().__init__(lr_staleness_modulation)
        if grads_to_wait < 0:
            raise ValueError(
                f"grads_to_wait must be at least 0 (0: one per live worker). Received: {grads_to_wait}"
            )
        self.configured_grads_to_wait = grads_to_wait
        # Following the live workers: 1 until the master's first count (it tells a rise at once).
        self.effective_grads_to_wait = grads_to_wait or 1
        self.version_tolerance = version_tolerance
        self._sums: dict[str, np.ndarray | RowGradientSum | NonTrainableChange] = {}
        self._count = 0
        self._learning_rate: float | None = None

    @property
    def grads_to_wait(self) -> int:
        return self.effective_grads_to_wait

    @property
    def follows_live_workers(self) -> bool:
        return self.configured_grads_to_wait == FOLLOW_LIVE_WORKERS

    @property
    def pending(self) -> int:
        return self._count

    def push(self, shard, grads, version, learning_rate):
        staleness = shard.version - version
        if staleness > self.version_tolerance or staleness < 0:
            self.telemetry.rejected_stale(shard.version)
            return PushResult(
                PushOutcome.REJECTED_STALE,
                shard.version,
                f"stale gradient: computed on version {version}, the model is at {shard.version} "
                f"(--sync_version_tolerance={self.version_tolerance})",
            )
        scale = np.float32(self._staleness_scale(staleness))
        if self._count == 0 and self.effective_grads_to_wait == 1 and scale == 1:
            # One gradient per version: nothing to average, so no copy to sum into.
            self.telemetry.accepted(shard.version, staleness)
            shard.apply(grads, learning_rate)
            return PushResult(PushOutcome.APPLIED, shard.version)
        for name, grad in grads.items():
            if isinstance(grad, IndexedRows):
                self._sums.setdefault(name, RowGradientSum()).add(grad, scale)
                continue
            if isinstance(grad, NonTrainableChange):
                change = self._sums.get(name)
                if change is None:
                    self._sums[name] = NonTrainableChange(np.array(grad.values, dtype=np.float32))
                else:
                    change.values[...] += grad.values
                continue
            acc = self._sums.get(name)
            if acc is None:
                self._sums[name] = np.array(grad, dtype=np.float32) * scale
            elif scale == 1:
                acc += grad
            else:
                acc += grad * scale
        self._count += 1
        if learning_rate is not None:
            self._learning_rate = learning_rate
        self.telemetry.accepted(shard.version, staleness)
        applied = self._apply_if_ready(shard)
        return PushResult(PushOutcome.APPLIED if applied else PushOutcome.ACCEPTED_PENDING, shard.version)

    def set_live_workers(self, shard, count):
        wanted = count if self.follows_live_workers else min(self.configured_grads_to_wait, count)
        effective = max(1, wanted)
        if effective == self.effective_grads_to_wait:
            return False
        self.effective_grads_to_wait = effective
        return self._apply_if_ready(shard)

    def _apply_if_ready(self, shard: ParameterShard) -> bool:
        if self._count == 0 or self._count < self.effective_grads_to_wait:
            return False
        inverse = np.float32(1.0 / self._count)
        for name, acc in self._sums.items():
            if isinstance(acc, RowGradientSum):
                self._sums[name] = acc.mean(self._count)
            elif isinstance(acc, NonTrainableChange):
                acc.values[...] *= inverse
            else:
                acc *= inverse
        shard.apply(self._sums, self._learning_rate)
        self._sums, self._count, self._learning_rate = {}, 0, None
        return True
