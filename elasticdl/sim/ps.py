"""A simulated parameter server: the real ParameterServer core behind the simulated network.

``SimShard`` serves one core: what the workers call (pull, push, push_model, table infos) and
what the master calls directly (live workers, fence, roll back, checkpoint, stats). Each call
updates the oracle (sim/oracle.py) from what the real core did: accepted pushes, versions made,
checkpoints written, restores. ``SimPS`` is the process: its own shard's core and, with
``--ps_replicas``, the real ``ReplicaHost`` with the backup cores of the shards before it and
the calls routed by shard (a shard whose primary is elsewhere answers "moved").
"""

from __future__ import annotations

import numpy as np

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.replica_host import ReplicaHost, backup_core
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc import replica_commands as wire
from elasticdl.rpc.ps_client import PushAnswer
from elasticdl.sim.model import EMBEDDING, LEARNING_RATE
from elasticdl.sim.modes import Mode
from elasticdl.sim.oracle import Oracle
from elasticdl.sim.replicas import SimForwarder
from elasticdl.sim.scheduler import Future
from elasticdl.sim.transport import Deferred, Unavailable

CHECKPOINT_STEPS = 4


def settings_for(mode: Mode, ps_id: int, checkpoint_dir: str, term: int, restore_from: str = "",
                 fence_floor: int = 0) -> PSSettings:
    return PSSettings(
        ps_id=ps_id, num_ps=mode.num_ps, grads_to_wait=mode.grads_to_wait, use_async=mode.use_async,
        checkpoint_dir=checkpoint_dir, checkpoint_steps=CHECKPOINT_STEPS if checkpoint_dir else 0,
        keep_checkpoint_max=3, checkpoint_dir_for_init=restore_from, term=term, fence_floor=fence_floor,
        restore_position=bool(restore_from),
    )


def _optimizer():
    return make_optimizer(OptimizerSpec("SGD", {"learning_rate": LEARNING_RATE}))


class SimPS:
    """One PS process (an incarnation: a relaunch makes a new one)."""

    def __init__(self, ps_id: int, settings: PSSettings, oracle: Oracle, world=None, replicas: int = 0,
                 moved_to: tuple[tuple[int, int], ...] = ()) -> None:
        self.ps_id = ps_id
        self.oracle = oracle
        self.world = world
        self.alive = False  # serving: set once started
        self.frozen = False
        self.core = ParameterServer(settings, _optimizer())
        self.host: ReplicaHost | None = None
        self.shards: dict[int, SimShard] = {ps_id: SimShard(self, ps_id, self.core)}
        self._replicas, self._moved_to = replicas, dict(moved_to)

    def start(self) -> None:
        """Load the checkpoint it was started with (raises CheckpointError when it cannot), then,
        with replicas, its backup cores (ps/main.py: serve_replicas after the restore)."""
        self.core.restore()
        if self.core.settings.checkpoint_dir_for_init:
            self.oracle.restored(self.ps_id, self.core.shard.version)
        if self._replicas:  # with the simulated forwarder in place of gRPC's
            self.host = ReplicaHost(self.core, self._replicas,
                                    lambda shard: backup_core(self.core, shard, _optimizer()), self._moved_to)
            self.host.forwarder = SimForwarder(self)
        self.alive = True

    def led(self) -> list[int]:
        """The shards this PS serves as primary."""
        if self.host is None:
            return [self.ps_id]
        return [s for s in self.host.cores if self.host.primary_here(s)]

    def server(self, shard: int) -> SimShard:
        """The master's calls for ``shard`` (its primary is here: the master's routes say so)."""
        if shard not in self.shards:
            if self.host is None or shard not in self.host.cores:
                raise Unavailable(f"ps-{self.ps_id} holds no replica of shard {shard}")
            self.shards[shard] = SimShard(self, shard, self.host.cores[shard])
        return self.shards[shard]

    def for_shard(self, shard: int) -> SimShard:
        """ShardRouter: a call for a shard this PS is not the primary of is answered "moved"."""
        if self.host is not None and not self.host.primary_here(shard):
            raise Unavailable(f"{wire.MOVED}: shard {shard}'s primary is PS {self.host.routes.primary[shard]}")
        return self.server(shard)

    def __getattr__(self, name: str):
        # Calls without a shard are for this PS's own (as without SHARD_HEADER on the wire).
        if name.startswith("rpc_") or name in MASTER_CALLS:
            return getattr(self.for_shard(self.ps_id), name)
        raise AttributeError(name)

    # ------------------------------------------------------------ replicas (PSReplica calls)

    def rpc_routes(self) -> wire.Routes:
        return self.host.routes

    def rpc_replicate(self, log, entry) -> None:
        """A forwarded update (the backup's side, ReplicaHost.replicate)."""
        applier = self.host.appliers.get(entry.shard)
        if applier is None:
            raise Unavailable(f"ps-{self.ps_id} is no backup of shard {entry.shard}")
        # One thread only: an entry ahead of its turn fails at once, and the primary sends it again.
        applier.gap_wait = 0.0
        before = applier.applied
        try:
            applier.receive(entry)
        except (ConnectionError, KeyError, ValueError) as err:  # ReplicaService.replicate: the primary sends it again
            raise Unavailable(f"{type(err).__name__}: {err}") from None
        if applier.applied != before:
            self.check_backup(log, entry.shard)

    def check_backup(self, log, shard: int) -> None:
        problem = self.world.replica_ledger.mismatch(log, self.host.appliers[shard].applied, self.host.cores[shard])
        if problem:
            self.world.violation(f"{problem} (PS {self.ps_id})")

    def configure(self, routes: wire.Routes, backups: bool = True) -> None:
        self._serving()
        self.host.configure([], None, "", routes, backups)
        for shard in self.led():
            log = self.host.cores[shard].replication
            if log is not None and log not in self.world.replica_ledger.history:
                self.world.replica_ledger.record(log, self.host.cores[shard], self.oracle.shards[shard])

    def _serving(self) -> None:
        if not self.alive or self.frozen:
            raise Unavailable(f"ps-{self.ps_id} is not serving")


def _after(forwarded: Future, answer, acknowledged=None) -> Future:
    """The answer, once the forwards are done (their error instead: the PS died meanwhile)."""
    done = Future()

    def settle() -> None:
        if forwarded.error is None and acknowledged is not None:
            acknowledged()
        done.resolve(answer if forwarded.error is None else None, forwarded.error)

    if forwarded.done:
        settle()
    else:
        forwarded.waiters.append(settle)
    return done


MASTER_CALLS = ("set_live_workers", "level_version", "fence", "roll_back", "checkpoint_at", "save_checkpoint",
                "take_snapshot", "drop_snapshot", "version", "stats")


class SimShard:
    """The calls of one shard's core on a PS (its own, or one it leads after a promotion)."""

    def __init__(self, owner: SimPS, shard: int, core: ParameterServer) -> None:
        self.owner = owner
        self.ps_id = shard  # the oracle's index: the shard
        self.core = core

    @property
    def oracle(self) -> Oracle:
        return self.owner.oracle

    def _forwarded(self, worker: bool):
        """--ps_replicas: the updates this call numbered, forwarded to the backups before the
        answer (a worker's: a Deferred answer; the master's: at once, or the command fails)."""
        host = self.owner.host
        if host is None:
            return None
        log = self.core.replication
        if log is not None and (log not in self.owner.world.replica_ledger.history
                                or log.seq not in self.owner.world.replica_ledger.history[log]):
            self.owner.world.replica_ledger.record(log, self.core, self.oracle.shards[self.ps_id])
        forwards = host.forwarder.take()
        if not forwards:
            return None
        if worker:
            return host.forwarder.deliver(forwards)
        host.forwarder.flush(forwards)
        return None

    # ------------------------------------------------------------ the oracle

    def _observe(self, call, worker: bool = False):
        """Run ``call`` on the core and note what it did: versions made and checkpoints written;
        then forward what it numbered to the backups. A worker's call returns (its result, the
        forwards' Future or None); the master's, its result."""
        core = self.core
        before = (core.shard.version, core._last_checkpoint_version)
        result = call()
        if core.shard.version != before[0]:
            self.oracle.version_made(self.ps_id)
        if core._last_checkpoint_version != before[1] and core.shard.version == core._last_checkpoint_version:
            self.oracle.checkpointed(self.ps_id, core._last_checkpoint_version)
        self.oracle.check_counts(self.ps_id, core.position.records_applied)
        forwarded = self._forwarded(worker)
        return (result, forwarded) if worker else result

    def _serving(self) -> None:
        self.owner._serving()

    # ------------------------------------------------------------ worker calls (network)

    def rpc_pull(self, version: int, ids: list[int]):
        initialized, now, params = self.core.pull(version)
        rows = {}
        mine = np.array([i for i in ids if i % self.core.settings.num_ps == self.ps_id], np.int64)
        if initialized and mine.size and EMBEDDING in self.core.shard.embeddings:
            looked_up = self.core.lookup_embeddings(EMBEDDING, mine, create=True)
            rows = {int(i): np.array(r, np.float32) for i, r in zip(mine, looked_up)}
        return initialized, now, {n: np.array(v) for n, v in params.items()}, rows

    def rpc_push(self, grads: dict, version: int, want_params: bool, batch, keys: tuple):
        log = self.core.replication
        seq = log.seq if log is not None else 0

        def push():
            result = self.core.push_gradients(grads, version, None, batch=batch)
            if result.accepted and result.reason != "already applied":
                self.oracle.accepted(self.ps_id, keys)
            return result

        result, forwarded = self._observe(push, worker=True)
        params = None
        if want_params and result.applied:
            params = {n: np.array(v) for n, v in self.core.shard.params.items()}
        answer = PushAnswer(result.outcome, result.version, result.reason, params)
        if log is None:
            return answer
        ledger = self.owner.world.replica_ledger
        entry_seq = log.seq if log.seq != seq else 0  # the number this push's update was given
        if entry_seq:
            ledger.pushed(log, entry_seq, batch)
        elif result.reason == "already applied" and batch is not None:
            ledger.retry_acknowledged(log, batch)  # answered now: the update that took it counts
        if forwarded is None:
            ledger.acknowledged(log, entry_seq)
            return answer
        return Deferred(_after(forwarded, answer, lambda: ledger.acknowledged(log, entry_seq)))

    def rpc_pull_snapshot(self, snapshot_id: int, ids: list[int]):
        """(version, params, rows) of an evaluation snapshot; None when this PS holds none (NOT_FOUND)."""
        try:
            _, version, params = self.core.pull_snapshot(snapshot_id)
            mine = np.array([i for i in ids if i % self.core.settings.num_ps == self.ps_id], np.int64)
            rows = {}
            if mine.size and EMBEDDING in self.core.shard.embeddings:
                looked_up = self.core.lookup_embeddings(EMBEDDING, mine, create=False, snapshot_id=snapshot_id)
                rows = {int(i): np.array(r, np.float32) for i, r in zip(mine, looked_up)}
        except KeyError:
            return None
        return version, {n: np.array(v) for n, v in params.items()}, rows

    def rpc_push_model(self, params: dict, version: int = 0):
        taken, forwarded = self._observe(lambda: self.core.push_model(params, version)[0], worker=True)
        if forwarded is None:
            return taken
        return Deferred(_after(forwarded, taken))

    def rpc_push_table_infos(self, infos) -> None:
        self.core.push_embedding_table_infos(infos)

    # ------------------------------------------------------------ master calls (direct)

    def set_live_workers(self, count: int) -> None:
        self._serving()
        self._observe(lambda: self.core.set_live_workers(count))

    def level_version(self, version: int, term: int) -> int:
        self._serving()
        return self._observe(lambda: self.core.level_version(version, term))

    def fence(self, handouts: list[int], task_ids: list[int], term: int) -> dict[int, int]:
        self._serving()
        return self._observe(lambda: self.core.fence(handouts, task_ids, term))

    def roll_back(self, path: str, term: int, fence_floor: int) -> int:
        self._serving()
        version = self.core.roll_back(path, term, fence_floor)
        self.oracle.restored(self.ps_id, version)
        return version

    def checkpoint_at(self, version: int, term: int) -> str:
        self._serving()
        return self._observe(lambda: self.core.checkpoint_at(version, term))

    def save_checkpoint(self) -> str:
        self._serving()
        return self._observe(self.core.save_checkpoint)

    def take_snapshot(self, round_id: int) -> int:
        self._serving()
        return self.core.take_snapshot(round_id)

    def drop_snapshot(self, round_id: int) -> None:
        self._serving()
        self.core.drop_snapshot(round_id)

    def version(self) -> int:
        self._serving()
        return self.core.shard.version

    def stats(self):
        self._serving()
        return self.core.stats()

