"""Shard replicas in the simulator (``--ps_replicas``, docs/replicas.md): the real primary's log
and backup's applier (elasticdl/ps/replication.py) and the real ``ReplicaHost``, with forwards
carried by the simulated network instead of gRPC threads.

``SimForwarder`` stands where ``GrpcForwarder`` stood. The real ``PrimaryLog.deliver`` hands it
each entry; it queues the entry instead of blocking, and the simulated PS answers the push only
once every queued forward was taken (or its backup was taken off the shard's list): the real
rule "answered once every backup took it", in simulated time. A forward that fails (the backup
down, frozen past the call's timeout, the message lost, an entry ahead of it not there yet) is
sent again after ``FORWARD_RETRY_SECONDS`` while its backup is listed, as ``_deliver_to`` does.

``ReplicaLedger`` is the oracle's side: after every update a primary numbers, the shard's state
(a fingerprint of what a backup must hold bit for bit) and the ghost's records, by (log, number).
A backup that applied number n must equal the primary at n; a promoted backup must hold every
update its primary acknowledged, and its records become the shard's ghost.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from elasticdl.ps.replication import FORWARD_RETRY_SECONDS, Entry, PrimaryLog
from elasticdl.sim.scheduler import Future
from elasticdl.sim.transport import Call, Unavailable


def fingerprint(core) -> str:
    """What a backup must hold exactly as its primary: model, version, data position, the sync
    average's pending gradients."""
    digest = hashlib.sha1(usedforsecurity=False)  # a fingerprint of state, not a secret
    shard, position = core.shard, core.position
    digest.update(repr((shard.initialized, shard.version, shard.step, position.records_applied,
                        sorted(position.marks.items()), position.fence_floor, sorted(position.fenced),
                        core.strategy.pending)).encode())
    for name in sorted(shard.params):
        digest.update(name.encode())
        digest.update(shard.params[name].tobytes())
    return digest.hexdigest()


@dataclass
class Snap:
    """A shard's state right after its primary numbered an update."""

    fingerprint: str
    applied: Counter
    pending: list
    maybe_missing: bool


@dataclass
class ReplicaLedger:
    """Per primary log: the state at each update number, and the highest one acknowledged."""

    history: dict[PrimaryLog, dict[int, Snap]] = field(default_factory=dict)
    acked: dict[PrimaryLog, int] = field(default_factory=dict)
    pushes: dict[PrimaryLog, list[tuple[int, object]]] = field(default_factory=dict)  # (seq, batch) of pushes

    def record(self, log: PrimaryLog, core, ghost) -> None:
        self.history.setdefault(log, {})[log.seq] = Snap(fingerprint(core), Counter(ghost.applied),
                                                         list(ghost.pending), ghost.maybe_missing)

    def pushed(self, log: PrimaryLog, seq: int, batch) -> None:
        if batch is not None:
            self.pushes.setdefault(log, []).append((seq, batch))

    def acknowledged(self, log: PrimaryLog, seq: int) -> None:
        self.acked[log] = max(self.acked.get(log, 0), seq)

    def retry_acknowledged(self, log: PrimaryLog, batch) -> None:
        """A retry answered "already applied": the entry that took the batch counts as acknowledged."""
        seqs = [seq for seq, b in self.pushes.get(log, ()) if b.task_id == batch.task_id
                and b.handout == batch.handout and b.records_end >= batch.records_end]
        if seqs:
            self.acknowledged(log, min(seqs))

    def mismatch(self, log: PrimaryLog, seq: int, core) -> str:
        """'' when ``core`` (a backup at update ``seq`` of ``log``) holds what its primary held."""
        snap = self.history.get(log, {}).get(seq)
        if snap is None or snap.fingerprint == fingerprint(core):
            return ""
        return f"a backup of shard {log.shard} at update {seq} differs from what its primary held then"


@dataclass
class Forward:
    backup: int
    log: PrimaryLog
    entry: Entry


class SimForwarder:
    """One PS's forwards (the ``forwarder`` of its real ReplicaHost)."""

    def __init__(self, owner) -> None:
        self.owner = owner  # the SimPS that sends
        self.queued: list[Forward] = []

    def set_addresses(self, addresses) -> None:
        pass  # the simulated network finds every PS by its name

    def forward(self, backup: int, entry: Entry) -> None:
        log = self.owner.host.cores[entry.shard].replication
        self.queued.append(Forward(backup, log, entry))

    def install(self, backup: int, shard: int, seq: int, snapshot: bytes) -> None:
        """The catch-up's snapshot, sent while the master waits (its AddBackup command)."""
        target = self.owner.world.ps[backup]
        if target is None or not target.alive or target.frozen:
            raise ConnectionError(f"PS {backup} did not take shard {shard}'s snapshot")
        target.host.install(json.dumps({"shard": shard, "seq": seq}), snapshot)
        target.check_backup(self.owner.host.cores[shard].replication, shard)

    def take(self) -> list[Forward]:
        queued, self.queued = self.queued, []
        return queued

    # ------------------------------------------------------------ delivery in simulated time

    def deliver(self, forwards: list[Forward]) -> Future:
        """Resolves once every forward was taken or its backup taken off (Unavailable if the
        sending PS died meanwhile: its answer never leaves)."""
        done = Future()
        left = [len(forwards)]
        if not forwards:
            done.resolve()
            return done

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                if self.owner.alive:
                    done.resolve()
                else:
                    done.resolve(error=Unavailable(f"ps-{self.owner.ps_id} died before its backups took the update"))

        for forward in forwards:
            self._attempt(forward, one_done)
        return done

    def flush(self, forwards: list[Forward]) -> None:
        """A master's command waits while its update is forwarded (at once, in simulated time);
        a backup that cannot take it now makes the command fail (it timed out), and the forward
        goes on in the background."""
        failed = []
        for forward in forwards:
            target = self.owner.world.ps[forward.backup]
            try:
                if forward.backup not in forward.log.backups:
                    continue
                if target is None or not target.alive or target.frozen:
                    raise Unavailable(f"ps-{forward.backup} is not serving")
                target.rpc_replicate(forward.log, forward.entry)
            except Unavailable:
                failed.append(forward)
        if failed:
            for forward in failed:
                self._attempt(forward, lambda: None)
            raise Unavailable(f"ps-{self.owner.ps_id}: a backup did not take the update in time")

    def _attempt(self, forward: Forward, done) -> None:
        world = self.owner.world
        if not self.owner.alive or forward.backup not in forward.log.backups:
            done()
            return
        if self.owner.frozen:  # SIGSTOP stops its forwarding threads too
            world.scheduler.at(FORWARD_RETRY_SECONDS, lambda: self._attempt(forward, done))
            return
        answer = world.network.send(Call(f"ps-{forward.backup}", "replicate", (forward.log, forward.entry)))

        def answered() -> None:
            if answer.error is None:
                done()
            else:
                world.scheduler.at(FORWARD_RETRY_SECONDS, lambda: self._attempt(forward, done))

        if answer.done:
            answered()
        else:
            answer.waiters.append(answered)
