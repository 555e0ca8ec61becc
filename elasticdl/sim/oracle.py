"""The simulator's ghost ledger: which records' gradients each PS holds, kept beside the real
code and never read by it.

Every push carries its records' keys (epoch, record index). A push the PS accepted (not a
retry it recognised) puts them in the PS's pending list; the next version the PS makes applies
them. A checkpoint remembers the PS's set; a rollback or restore brings it back; a PS that
restarts empty holds nothing of its own, and what it may miss is counted as possibly missing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ShardGhost:
    applied: Counter = field(default_factory=Counter)
    pending: list = field(default_factory=list)
    saved: dict[int, Counter] = field(default_factory=dict)  # checkpoint version -> applied
    maybe_missing: bool = False  # restarted empty: its records may be missing


@dataclass
class Oracle:
    num_ps: int
    violations: list[str] = field(default_factory=list)
    shards: list[ShardGhost] = field(default_factory=list)
    now: object = None  # the clock, for messages

    def __post_init__(self) -> None:
        self.shards = [ShardGhost() for _ in range(self.num_ps)]

    def violation(self, message: str) -> None:
        when = f"t={self.now():.3f}s: " if self.now else ""
        self.violations.append(when + message)

    def accepted(self, ps: int, keys: tuple) -> None:
        self.shards[ps].pending.extend(keys)

    def version_made(self, ps: int) -> None:
        shard = self.shards[ps]
        for key in shard.pending:
            shard.applied[key] += 1
            if shard.applied[key] > 1:
                self.violation(f"PS {ps} applied record {key[1]}'s gradient {shard.applied[key]} times in epoch "
                               f"{key[0] + 1}")
        shard.pending.clear()

    def checkpointed(self, ps: int, version: int) -> None:
        self.shards[ps].saved[version] = Counter(self.shards[ps].applied)

    def restored(self, ps: int, version: int) -> None:
        shard = self.shards[ps]
        if version not in shard.saved:
            self.violation(f"PS {ps} restored version {version}, a checkpoint it never wrote")
            return
        shard.applied = Counter(shard.saved[version])
        shard.pending.clear()

    def emptied(self, ps: int) -> None:
        """Restarted without a checkpoint: it holds the workers' copy, none of its own records."""
        shard = self.shards[ps]
        shard.applied, shard.maybe_missing = Counter(), True
        shard.pending.clear()

    def lost_pending(self, ps: int) -> None:
        self.shards[ps].pending.clear()

    def check_counts(self, ps: int, records_applied: int) -> None:
        """The PS's own count of records applied against the ghost's."""
        ghost = sum(self.shards[ps].applied.values())
        if not self.shards[ps].maybe_missing and ghost != records_applied:
            self.violation(f"PS {ps} counts {records_applied} records applied, its pushes applied {ghost}")

    def check_complete(self, epochs: int, records: int, trained_epochs: int) -> None:
        """At the job's end: every record of every epoch trained, once, on every shard."""
        for ps, shard in enumerate(self.shards):
            missing = [(e, r) for e in range(min(epochs, trained_epochs)) for r in range(records)
                       if shard.applied[(e, r)] == 0]
            if missing and not shard.maybe_missing:
                self.violation(f"PS {ps} never applied {len(missing)} records' gradients, e.g. record "
                               f"{missing[0][1]} of epoch {missing[0][0] + 1}")
