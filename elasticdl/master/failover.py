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
from collections.abc import Sequence
from dataclasses import dataclass, field

from elasticdl.launch.exits import ProcessExit
from elasticdl.master.events import (
    AddBackup,
    BackupAdded,
    BackupNotAdded,
    BackupPromoted,
    Decision,
    PromoteBackup,
    PromotionFailed,
    RelaunchPS,
)
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


@dataclass(frozen=True)
class StoredRoles:
    """The roles a master recorded in the state store (docs/replicas.md, "Roles in the state
    store"), read back by the master that resumes the job: per shard its primary's PS and its
    caught-up backups, and the highest leadership term that wrote them."""

    term: int
    primary: tuple[int, ...]
    backups: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, stored: dict[int, dict], num_ps: int) -> StoredRoles | None:
        """None when nothing is stored (a job never run with --ps_replicas). ValueError when the
        stored roles do not fit this job: other shards, a PS out of range, or not exactly one
        primary per shard."""
        if not stored:
            return None
        if sorted(stored) != list(range(num_ps)):
            raise ValueError(f"roles stored for shards {sorted(stored)}, the job has {num_ps} (--num_ps)")
        primary, backups = [], []
        for shard in range(num_ps):
            replicas = stored[shard]["replicas"]
            leaders = [ps for ps, role in replicas.items() if role == "primary"]
            if len(leaders) != 1 or not all(0 <= ps < num_ps for ps in replicas):
                raise ValueError(f"shard {shard}'s stored roles {replicas} name no single primary among PS "
                                 f"0..{num_ps - 1}")
            primary.append(leaders[0])
            backups.append(tuple(sorted(ps for ps, role in replicas.items() if role == "backup")))
        return cls(max(int(v["term"]) for v in stored.values()), tuple(primary), tuple(backups))

    def moved(self) -> dict[int, int]:
        """Shard -> PS for each shard that was not led by its own PS (promoted elsewhere)."""
        return {s: p for s, p in enumerate(self.primary) if p != s}


@dataclass
class ReplicaRoles:
    primary: list[int]  # shard -> the PS of its primary
    backups: list[list[int]]  # shard -> the PS of its live, caught-up backups, in promotion order
    routes_version: int = 0
    records: list[FailoverRecord] = field(default_factory=list)
    _lost_at: dict[int, float] = field(default_factory=dict)  # dead PS -> when its exit was seen
    _exits: dict[int, ProcessExit] = field(default_factory=dict)  # dead PS -> its exit, while promoting
    replicas: int = 0
    _spares: set[int] = field(default_factory=set)  # relaunched PS not caught up as backups yet
    _adding: set[int] = field(default_factory=set)  # spares whose AddBackup is being carried out
    _readd: dict[int, set[int]] = field(default_factory=dict)  # live PS -> shards it must catch up on again

    @classmethod
    def initial(cls, num_ps: int, replicas: int) -> ReplicaRoles:
        """Shard i on PS i, its backups on PS i+1 ... i+R (mod P)."""
        return cls(list(range(num_ps)), [[(s + k) % num_ps for k in range(1, replicas + 1)] for s in range(num_ps)],
                   replicas=replicas)

    def moved_to(self) -> tuple[tuple[int, int], ...]:
        """(shard, PS) for each shard whose primary is not on its own PS: a relaunched PS starts
        with these routes, so that it serves none of the shards it led."""
        return tuple((s, p) for s, p in enumerate(self.primary) if p != s)

    def ps_lost(self, dead: int, now: float) -> PromoteBackup:
        """The decision for PS ``dead``'s exit: promotions if the recovery policy plans them (none
        when it led no shard: a spare or a backup only); else a fallback, every shard back on its
        own PS with no backup, before the cut's relaunch."""
        led = tuple(s for s, p in enumerate(self.primary) if p == dead)
        plan = plan_failover(FailoverFacts(dead, led, tuple(tuple(b) for b in self.backups)))
        self._lost_at[dead] = now
        if plan is None:  # a shard has no live replica: every PS goes back to the cut
            return self._fall_back(dead)
        self.routes_version += 1
        for shard, ps in plan.promotions:
            self.primary[shard] = ps
            # The new primary numbers its updates afresh, and another backup may lack the last one
            # the dead primary forwarded: each other backup catches up again from a snapshot.
            for other in self.backups[shard]:
                if other not in (dead, ps):
                    self._readd.setdefault(other, set()).add(shard)
            self.backups[shard] = []
        self.backups = [[b for b in backups if b != dead and b != self.primary[s]]
                        for s, backups in enumerate(self.backups)]
        self._readd.pop(dead, None)
        return PromoteBackup(dead, plan.promotions, tuple(tuple(b) for b in self.backups), tuple(self.primary),
                             self.routes_version)

    def _fall_back(self, dead: int) -> PromoteBackup:
        """Every shard back on its own PS, with no backup: the survivors roll back to the cut, and
        their backups would not. A live PS that holds no caught-up replica of its own shard (a
        spare still catching up) has nothing to serve it from: it is ``lost`` with the dead one."""
        lost = self.lost_without(dead)
        self.primary = list(range(len(self.primary)))
        self.backups = [[] for _ in self.primary]
        self.routes_version += 1
        self._spares.clear()
        self._readd.clear()
        return PromoteBackup(dead, (), tuple(() for _ in self.primary), tuple(self.primary), self.routes_version,
                             fallback=True, lost=lost)

    def lost_without(self, dead: int) -> tuple[int, ...]:
        """The live PS other than ``dead`` that hold no caught-up replica of their own shard: it
        is led elsewhere (they were relaunched as spares) and they do not back it up. A spare's
        core of its own shard is empty, and one in catch-up counts as holding nothing until its
        ``BackupAdded``: the simulator found such a spare serving its empty shard after a
        fallback without a checkpoint, its records not counted missing (seeds 185, 192, 359)."""
        return tuple(ps for ps, primary in enumerate(self.primary)
                     if ps != dead and primary != ps and ps not in self.backups[ps])

    def survives(self, dead: int) -> bool:
        """Whether PS ``dead``'s death costs nothing: every shard it leads has a live backup."""
        led = tuple(s for s, p in enumerate(self.primary) if p == dead)
        return plan_failover(FailoverFacts(dead, led, tuple(tuple(b) for b in self.backups))) is not None

    def ps_exited(self, exit_: ProcessExit, now: float) -> list[Decision]:
        """The controller's decisions for a PS's exit: promotions (the relaunch waits for their
        answer); none needed (it led no shard): the backup lists updated and a spare's relaunch;
        a shard that lost every replica: the fallback and the cut's relaunch."""
        promote = self.ps_lost(exit_.index, now)
        self._spares.discard(exit_.index)
        self._adding.discard(exit_.index)
        if promote.fallback:
            return [promote, RelaunchPS(exit_)]
        if not promote.promotions:
            self._spares.add(exit_.index)
            return [promote, RelaunchPS(exit_, moved_to=self.moved_to())]
        self._exits[exit_.index] = exit_
        return [promote]

    def answered(self, event, now: float) -> list[Decision]:
        """The answer to ``PromoteBackup`` (relaunch the dead PS: as a spare once its shards were
        promoted; after a failed promotion, from the cut) or to ``AddBackup``."""
        if isinstance(event, BackupAdded | BackupNotAdded):
            self._adding.discard(event.ps)
            if isinstance(event, BackupAdded):
                if event.complete:  # else it stays a spare (or a re-add) for the shards still short
                    self._spares.discard(event.ps)
                    self._readd.pop(event.ps, None)
                for shard in event.shards:
                    if event.ps not in self.backups[shard]:
                        self.backups[shard].append(event.ps)
            return []
        exit_ = self._exits.pop(event.dead, None)
        if exit_ is None:
            return []
        if isinstance(event, PromotionFailed):
            logger.error("promoting the backups of PS %d's shards failed (%s): the job goes back to the "
                         "checkpoint cut", event.dead, event.reason)
            return [self._fall_back(event.dead), RelaunchPS(exit_)]
        self.promoted(event, now)
        self._spares.add(event.dead)
        return [RelaunchPS(exit_, moved_to=self.moved_to())]  # nothing rolled back

    def due(self) -> list[Decision]:
        """At a Tick: each spare becomes a backup of the shards short of backups (not its own), and
        a backup of a shard whose primary changed catches up with the new one."""
        decisions: list[Decision] = []
        for ps in sorted((self._spares | set(self._readd)) - self._adding):
            shards = tuple(s for s, p in enumerate(self.primary)
                           if p != ps and ps not in self.backups[s] and len(self.backups[s]) < self.replicas
                           and (ps in self._spares or s in self._readd.get(ps, ())))
            if shards:
                self._adding.add(ps)
                decisions.append(AddBackup(ps, shards, tuple(self.primary), self.routes_version))
        return decisions

    def promoted(self, event: BackupPromoted, now: float) -> None:
        since = self._lost_at.pop(event.dead, now)
        versions = event.versions or (0,) * len(event.promotions)
        for (shard, ps), version in zip(event.promotions, versions):
            self.records.append(FailoverRecord(shard, event.dead, ps, now - since, version))


def predecessor_claims(claims: Sequence[int], decision: AddBackup) -> list[int]:
    """The shards PS ``decision.ps`` claims as their primary (``claims``: the routes it holds)
    although their primary is elsewhere now. A spare is started claiming none of them
    (``--moved_to``): such claims come from its predecessor, which can still answer at its address after it was seen dead. On Kubernetes a
    pod deleted with no grace is gone from the API, and its exit reported, before the kubelet has
    killed its process, and a pooled connection through the service still reaches it: the catch-up
    went to the dying process, the spare was counted a backup it never was, and the job hung
    (tests/test_k8s_replicas.py)."""
    return [s for s, ps in enumerate(claims) if ps == decision.ps and decision.primary[s] != decision.ps]
