"""Shard replicas: the primary's log of updates and a backup's in-order apply (docs/replicas.md).

The primary gives each update it takes a sequence number under its core's lock (``record``)
and, off the lock, forwards it to every backup of the shard before it answers (``deliver``):
whatever a worker saw acknowledged is on every live replica. A backup applies entries strictly
in sequence order with the primary's own code (``BackupApplier``), so both hold the same bits.

Pure Python, no gRPC: the forwarder is a callable (in one process: the backup's ``receive``;
between processes: elasticdl/ps/replica_wire.py). With ``--ps_replicas 0`` a core has no
``PrimaryLog`` and none of this runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A backup holds an entry that arrived before the one ahead of it at most this long; then the
# forward fails and the primary sends it again (the one ahead may have been lost with a broken call).
GAP_WAIT_SECONDS = 10.0
# The primary tries a failed forward again after this long, while the backup is still listed.
FORWARD_RETRY_SECONDS = 0.2

# "tables" and "lookup": embedding tables made, and a lookup that created or evicted rows
# (elasticdl/ps/replica_tables.py).
OPS = ("push", "model", "live_workers", "learning_rate", "fence", "level", "tables", "lookup")


@dataclass(frozen=True)
class Entry:
    """One update a primary took: ``op`` (one of OPS) and its arguments, ``seq`` its place."""

    shard: int
    seq: int
    op: str
    args: tuple


Forwarder = Callable[[int, Entry], None]  # (backup PS, entry); raises ConnectionError when not taken


class BackupGone(ConnectionError):
    """The backup was taken off the shard's replicas while an entry was on its way to it."""


class PrimaryLog:
    """The primary side of one shard: sequence numbers, and forwards that wait for the backups."""

    def __init__(self, shard: int, backups: list[int], forward: Forwarder, retry_seconds: float = FORWARD_RETRY_SECONDS):
        self.shard = shard
        self.seq = 0  # the last number given (under the core's lock)
        self.forward = forward
        self.retry_seconds = retry_seconds
        self._backups = list(backups)
        self._changed = threading.Condition()  # the backups changed: a waiting forward looks again
        self.forwards_failed = 0

    @property
    def backups(self) -> list[int]:
        with self._changed:
            return list(self._backups)

    def record(self, op: str, *args) -> Entry:
        """Number an update (call with the core's lock held, right where it was applied)."""
        self.seq += 1
        return Entry(self.shard, self.seq, op, args)

    def add_backup(self, backup: int) -> None:
        """A new backup (call with the core's lock held, where its snapshot is taken): every
        entry numbered from now on goes to it too."""
        with self._changed:
            if backup not in self._backups:
                self._backups.append(backup)

    def set_backups(self, backups: list[int]) -> None:
        """The master's list of live backups: a forward to one taken off ends at once."""
        with self._changed:
            self._backups = list(backups)
            self._changed.notify_all()

    def deliver(self, entry: Entry) -> None:
        """Forward ``entry`` to every listed backup (off the core's lock); returns once each took
        it or was taken off the list (its PS died: the master says so)."""
        for backup in self.backups:
            self._deliver_to(backup, entry)

    def _deliver_to(self, backup: int, entry: Entry) -> None:
        while True:
            try:
                self.forward(backup, entry)
                return
            except ConnectionError as err:
                self.forwards_failed += 1
                with self._changed:
                    if backup not in self._backups:
                        return
                    logger.warning("shard %d: forwarding update %d to its backup on PS %d failed (%s); "
                                   "the push waits until it is taken or the master takes the backup off",
                                   self.shard, entry.seq, backup, err)
                    self._changed.wait(self.retry_seconds)
                    if backup not in self._backups:
                        return


class BackupApplier:
    """A backup of one shard: takes forwarded entries in any order, applies them in sequence."""

    def __init__(self, core, gap_wait: float = GAP_WAIT_SECONDS, installed: bool = True):
        """``installed=False``: a new backup, which applies nothing before its snapshot came."""
        self.core = core  # the shard's ParameterServer on this PS
        self.applied = 0 if installed else -1  # the last sequence number applied (-1: no snapshot yet)
        self.gap_wait = gap_wait
        self.closed = False  # no longer this shard's backup (promoted, or caught up afresh)
        self._turn = threading.Condition()

    def receive(self, entry: Entry) -> None:
        """Apply ``entry`` once every entry before it is applied (a second copy: nothing).
        ConnectionError when the one before does not arrive within ``gap_wait`` (the primary
        sends it again)."""
        with self._turn:
            if entry.seq <= self.applied and not self.closed:
                return
            if not self._turn.wait_for(lambda: self.closed or self.applied >= entry.seq - 1, self.gap_wait):
                raise ConnectionError(f"shard {entry.shard}: update {entry.seq} arrived, {self.applied + 1} "
                                      f"did not within {self.gap_wait:g}s")
            if self.closed:  # applied now, it could come after a retry of the same push at the new primary
                raise ConnectionError(f"shard {entry.shard}: this PS is no longer its backup (promoted)")
            if entry.seq <= self.applied:  # a copy applied while this one waited
                return
            apply_entry(self.core, entry)
            self.applied = entry.seq
            self._turn.notify_all()


    def close(self) -> None:
        """No entry is applied from now on (one being applied finishes first); one waiting for
        its turn is refused."""
        with self._turn:
            self.closed = True
            self._turn.notify_all()

    def install(self, seq: int, snapshot: bytes) -> None:
        """The primary's state at update ``seq`` (elasticdl/ps/replica_snapshot.py): entries after
        it, held meanwhile, apply from now on."""
        from elasticdl.ps.replica_snapshot import load

        with self._turn:
            load(self.core, snapshot)
            self.applied = seq
            self._turn.notify_all()


def apply_entry(core, entry: Entry) -> None:
    """Apply a forwarded update to ``core`` as the primary applied it: a push skips the checks
    the primary made (it took it), but moves the gradient guard's running norm as it did."""
    args = entry.args
    match entry.op:
        case "push":
            grads, version, learning_rate, batch, _worker = args
            with core._lock:
                core.guard.problem(grads)  # measures it: the running norm then moves as the primary's
                core.guard.passed()
                core._push_locked(grads, version, learning_rate, batch)  # a backup writes no checkpoint
        case "model":
            core.push_model(*args)
        case "live_workers":
            core.set_live_workers(*args)
        case "learning_rate":
            core.set_learning_rate(*args)
        case "fence":
            core.fence(*args)
        case "level":
            core.level_version(*args)
        case "tables":
            core.push_embedding_table_infos(*args)
        case "lookup":
            from elasticdl.ps.replica_tables import apply_lookup

            apply_lookup(core, *args)
        case _:
            raise ValueError(f"unknown replicated update {entry.op!r}: one of {', '.join(OPS)}")


class ShardReplication:
    """The replication side of ``ParameterServer`` (its attributes are the server's): with a
    ``replication`` log, each update taken is numbered under the lock and delivered off it."""

    replication: PrimaryLog | None = None

    def _replicate_locked(self, op: str, *args) -> Entry | None:
        return self.replication.record(op, *args) if self.replication is not None else None

    def _deliver(self, entry: Entry | None) -> None:
        if entry is not None and self.replication is not None:
            self.replication.deliver(entry)
