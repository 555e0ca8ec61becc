"""Shard replicas in the controller (``--ps_replicas``, docs/replicas.md): who holds each shard,
and what a PS death changes. Pure: no I/O, no clock of its own; the controller calls it.

``ReplicaRoles`` keeps, per shard, its primary's PS and its live backups (caught up: they hold
every update the primary acknowledged). When a PS dies, the recovery policy's
``plan_failover`` says whether every shard it led has a live backup; then the controller
decides ``PromoteBackup`` (the first live backup on the ring becomes primary, the dead PS is
taken off every backup list), and once it is carried out (``BackupPromoted``), relaunches the
dead PS as a spare that serves none of its old shards (``RelaunchPS(moved_to=...)``). A shard
with no live replica left falls back to today's cut (``plan_ps_loss``): the backup lists are
emptied first, since the survivors roll back and their backups would not.

Example::

    roles = ReplicaRoles.initial(num_ps=2, replicas=1)
    decision = roles.ps_lost(1, now=10.0)       # PromoteBackup(dead=1, promotions=((1, 0),), ...)
    roles.promoted(BackupPromoted(decision.dead, decision.promotions, (12,)), now=10.4)
    roles.records                                # [FailoverRecord(shard=1, old=1, new=0, pause=0.4, ...)]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from elasticdl.launch.exits import ProcessExit
from elasticdl.master.events import BackupPromoted, Decision, PromoteBackup, PromotionFailed, RelaunchPS
from elasticdl.master.recovery_policy import FailoverFacts, plan_failover

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverRecord:
    """One shard's failover, for the report: ``pause`` seconds from the PS's exit seen to the
    backup promoted; the shard's model ``version`` then (nothing rolled back)."""

    shard: int
    old_primary: int
    new_primary: int
    pause_seconds: float
    version: int

    def to_dict(self) -> dict:
        return {"shard": self.shard, "old_primary": self.old_primary, "new_primary": self.new_primary,
                "pause_seconds": round(self.pause_seconds, 3), "version": self.version}


@dataclass
class ReplicaRoles:
    primary: list[int]  # shard -> the PS of its primary
    backups: list[list[int]]  # shard -> the PS of its live, caught-up backups, in promotion order
    routes_version: int = 0
    records: list[FailoverRecord] = field(default_factory=list)
    _lost_at: dict[int, float] = field(default_factory=dict)  # dead PS -> when its exit was seen
    _exits: dict[int, ProcessExit] = field(default_factory=dict)  # dead PS -> its exit, while promoting

    @classmethod
    def initial(cls, num_ps: int, replicas: int) -> ReplicaRoles:
        """Shard i on PS i, its backups on PS i+1 ... i+R (mod P)."""
        return cls(list(range(num_ps)), [[(s + k) % num_ps for k in range(1, replicas + 1)] for s in range(num_ps)])

    def moved_to(self) -> tuple[tuple[int, int], ...]:
        """(shard, PS) for each shard whose primary is not on its own PS: a relaunched PS starts
        with these routes, so that it serves none of the shards it led."""
        return tuple((s, p) for s, p in enumerate(self.primary) if p != s)

    def ps_lost(self, dead: int, now: float) -> PromoteBackup:
        """The decision for PS ``dead``'s exit: promotions if the recovery policy plans them, else
        (no promotions) the backup lists emptied before the fallback to the cut."""
        led = tuple(s for s, p in enumerate(self.primary) if p == dead)
        plan = plan_failover(FailoverFacts(dead, led, tuple(tuple(b) for b in self.backups)))
        self._lost_at[dead] = now
        if plan is None:  # a shard has no live replica: every PS goes back to the cut
            self.backups = [[] for _ in self.primary]
            return PromoteBackup(dead, (), tuple(() for _ in self.primary), tuple(self.primary), self.routes_version)
        for shard, ps in plan.promotions:
            self.primary[shard] = ps
        self.backups = [[b for b in backups if b != dead and b != self.primary[s]]
                        for s, backups in enumerate(self.backups)]
        self.routes_version += 1
        return PromoteBackup(dead, plan.promotions, tuple(tuple(b) for b in self.backups), tuple(self.primary),
                             self.routes_version)

    def ps_exited(self, exit_: ProcessExit, now: float) -> list[Decision]:
        """The controller's decisions for a PS's exit: promotions (the relaunch waits for their
        answer), or, when a shard lost every replica, the backups emptied and the cut's relaunch."""
        promote = self.ps_lost(exit_.index, now)
        if not promote.promotions:
            return [promote, RelaunchPS(exit_)]
        self._exits[exit_.index] = exit_
        return [promote]

    def answered(self, event: BackupPromoted | PromotionFailed, now: float) -> list[Decision]:
        """The answer to ``PromoteBackup``: relaunch the dead PS, as a spare once its shards were
        promoted; after a failed promotion, from the cut (and no backup is trusted any more)."""
        exit_ = self._exits.pop(event.dead, None)
        if exit_ is None:
            return []
        if isinstance(event, PromotionFailed):
            logger.error("promoting the backups of PS %d's shards failed (%s): the job goes back to the "
                         "checkpoint cut", event.dead, event.reason)
            self.backups = [[] for _ in self.primary]
            return [RelaunchPS(exit_)]
        self.promoted(event, now)
        return [RelaunchPS(exit_, moved_to=self.moved_to())]  # nothing rolled back

    def promoted(self, event: BackupPromoted, now: float) -> None:
        since = self._lost_at.pop(event.dead, now)
        versions = event.versions or (0,) * len(event.promotions)
        for (shard, ps), version in zip(event.promotions, versions):
            self.records.append(FailoverRecord(shard, event.dead, ps, now - since, version))
