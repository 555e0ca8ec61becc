"""What the job does when a PS is lost: a pure decision from the facts, no I/O.

The executor (``Recovery`` in elasticdl/master/recovery.py, and the simulator's master) gathers
the facts -- which PS died, the cuts found on disk and whether their checksums verified, whether
the job keeps checkpoints and a training ledger -- and carries out the plan this module returns:

- ``RestoreCut``: the newest verified cut of this lineage. The dead PS restores it, the
  survivors roll back to it, every hand-out is fenced and the ledger goes back to the cut's data
  position. Nothing is applied twice; what the ledger still counts done beyond what the cut holds
  (a rollback further back than the ledger remembers) is possibly missing.
- ``StartOver``: checkpoints are kept, but no cut is usable (none written yet, or every one damaged
  or partial). Refilling only the dead PS from a worker's copy would leave its shard's own count
  started over while the ledger keeps going: exactly once broken, and the shards at different
  versions. Instead every PS starts again empty at version 0 (refilled from a worker's copy, as
  at the job's start), the files of the abandoned timeline are removed, and the ledger goes back
  to the start: every record is trained again and counted once.
- ``RefillEmpty``: no ``--checkpoint_dir`` (or no training ledger): the dead PS starts empty and a
  worker gives it its copy; the updates since the workers' last pull are possibly missing.

A master that resumes a ledger (``plan_resume``) decides the same way, with every PS new: the cut
they restored, else (checkpoints kept, none usable) a start over, else ``KeepLedger``: without
checkpoints the ledger's done records are counted possibly missing, as documented.

Example::

    plan = plan_ps_loss(PSLossFacts(dead=1, num_ps=2, checkpoint_dir=True, trains=True, cuts=()))
    assert plan == StartOver(dead=1, restart=(0, 1), held=(0, 0))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "CutFound", "FailoverFacts", "KeepLedger", "PSLossFacts", "Plan", "Promote", "RefillEmpty", "RestoreCut",
    "ResumeFacts", "StartOver", "plan_failover", "plan_ps_loss", "plan_resume", "possibly_missing",
    "records_between_pulls",
]


@dataclass(frozen=True)
class CutFound:
    """A complete cut on disk, as the executor found it."""

    path: str  # its version directory
    version: int
    verified: bool  # every shard's checksums verified and its data position could be read
    marks: dict[int, int] = field(default_factory=dict)  # task id -> records applied up to (lowest over shards)
    records_applied: tuple[int, ...] = ()  # per shard, over the whole job


@dataclass(frozen=True)
class PSLossFacts:
    dead: int  # the PS that died
    num_ps: int
    checkpoint_dir: bool  # the job keeps checkpoints (--checkpoint_dir)
    trains: bool  # a training ledger exists (evaluate and predict have none to rewind)
    cuts: tuple[CutFound, ...] = ()  # this lineage's cuts, newest first (damaged ones unverified)
    missing_without_cut: int = 0  # records_between_pulls(...): a PS refilled from a worker's copy loses these


@dataclass(frozen=True)
class ResumeFacts:
    num_ps: int
    checkpoint_dir: bool  # the job keeps checkpoints (--checkpoint_dir)
    cut: CutFound | None  # the cut the PS were started from, read again once they serve (None: none)


@dataclass(frozen=True)
class RestoreCut:
    dead: int | None  # None: a resumed master (every PS restored the cut at its start)
    cut: CutFound
    survivors: tuple[int, ...]  # they roll back to the cut

    @property
    def version(self) -> int:
        return self.cut.version

    @property
    def marks(self) -> dict[int, int]:
        return self.cut.marks  # the ledger's rewind position

    @property
    def held(self) -> tuple[int, ...]:
        return self.cut.records_applied


@dataclass(frozen=True)
class StartOver:
    dead: int | None  # None: a resumed master (every PS is new and empty already)
    restart: tuple[int, ...]  # every PS: the survivors are stopped and all start empty at version 0
    held: tuple[int, ...]  # records each shard holds then: none

    version: int = 0
    marks: dict[int, int] = field(default_factory=dict)  # the ledger goes back to every task's start


@dataclass(frozen=True)
class RefillEmpty:
    dead: int
    missing: int  # records whose updates may be missing from its shard


@dataclass(frozen=True)
class KeepLedger:
    """A resumed master without checkpoints: the PS start from the initial model, and the
    records the ledger counts done are counted possibly missing (not trained again)."""


Plan = RestoreCut | StartOver | RefillEmpty


def plan_ps_loss(facts: PSLossFacts) -> Plan:
    """The plan for PS ``facts.dead``'s loss (see the module docstring)."""
    if not facts.checkpoint_dir or not facts.trains:
        return RefillEmpty(facts.dead, facts.missing_without_cut)
    survivors = tuple(i for i in range(facts.num_ps) if i != facts.dead)
    for cut in facts.cuts:
        # A cut counts only once its checksums verify and it holds one count per shard.
        if cut.verified and len(cut.records_applied) == facts.num_ps:
            return RestoreCut(facts.dead, cut, survivors)
    return StartOver(facts.dead, tuple(range(facts.num_ps)), (0,) * facts.num_ps)


@dataclass(frozen=True)
class FailoverFacts:
    """--ps_replicas: what the roles say when PS ``dead`` died (elasticdl/master/failover.py)."""

    dead: int
    led: tuple[int, ...]  # the shards whose primary ran on it
    backups: tuple[tuple[int, ...], ...]  # shard -> its live, caught-up backups, in promotion order


@dataclass(frozen=True)
class Promote:
    """Each (shard, PS): that backup becomes the shard's primary. Nothing is rolled back."""

    promotions: tuple[tuple[int, int], ...]


def plan_failover(facts: FailoverFacts) -> Promote | None:
    """Promotion is preferred to any cut: each shard the dead PS led goes to its first live
    backup (docs/replicas.md). None when one of them has no live backup (both replicas lost):
    then ``plan_ps_loss``, today's cut, for the whole job."""
    promotions = []
    for shard in facts.led:
        live = [ps for ps in facts.backups[shard] if ps != facts.dead]
        if not live:
            return None
        promotions.append((shard, live[0]))
    return Promote(tuple(promotions))


def plan_resume(facts: ResumeFacts) -> RestoreCut | StartOver | KeepLedger:
    """The plan for a master that resumed a ledger (see the module docstring)."""
    if not facts.checkpoint_dir:
        return KeepLedger()
    cut = facts.cut
    if cut is not None and cut.verified and len(cut.records_applied) == facts.num_ps:
        return RestoreCut(None, cut, ())
    return StartOver(None, tuple(range(facts.num_ps)), (0,) * facts.num_ps)


def possibly_missing(credited: int, held: Sequence[int]) -> int:
    """Records the ledger counts done (``credited``, bad records skipped in a pushed batch
    included) beyond the fewest any shard holds after the rewind: their updates may be missing.
    Without a count per shard, nothing is known to be missing."""
    return max(0, credited - min(held)) if held else 0


def records_between_pulls(get_model_steps: int, push_steps: int, overlap: bool, minibatch_size: int,
                          workers: int) -> int:
    """The records whose updates a PS refilled from a worker's copy lacks, at most: async workers
    pull every ``get_model_steps`` batches, rounded up to a whole push with ``push_steps`` (they
    pull only right after a push); with overlap, one batch's push is in flight besides."""
    between_pulls = -(-get_model_steps // push_steps) * push_steps + int(overlap)
    return between_pulls * minibatch_size * max(1, workers)
