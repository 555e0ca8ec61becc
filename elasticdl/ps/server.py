"""The parameter server's core: one lock around a shard, its updating strategy and checkpoints.

Pure Python (numpy, no TensorFlow, no protobuf): the gRPC servicer translates messages
and calls these methods; tests drive them directly.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np

from elasticdl import fs
from elasticdl.model import checkpoint
from elasticdl.model.checkpoint_owner import lineage_floor
from elasticdl.model.embedding.table import EmbeddingError, FrozenTable
from elasticdl.model.optimizers import Optimizer, learning_rate_problem
from elasticdl.model.slicing import DEFAULT_SLICE_ABOVE_MB, DenseSlicing
from elasticdl.ps.checkpointing import ShardCheckpoints
from elasticdl.ps.data_position import DataPosition
from elasticdl.ps.gradient_guard import DEFAULT_MAX_NORM_RATIO, GradientGuard
from elasticdl.ps.leveling import ShardLeveling
from elasticdl.ps.parameters import GradientError, ParameterShard
from elasticdl.ps.push_checks import check_push
from elasticdl.ps.replica_tables import ShardTables
from elasticdl.ps.replication import ShardReplication
from elasticdl.ps.strategies import (
    AverageUpdatingStrategy,
    DirectUpdatingStrategy,
    GradientUpdatingStrategy,
    PushResult,
    UpdateTelemetry,
)
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.rpc.trust import TicketVerifier

logger = logging.getLogger(__name__)

# A sync worker waits in a pull for the next version, and a waiting pull holds a thread of
# the PS's gRPC pool: with more sync workers than threads, none would be left for the pushes
# that make the version. Hence the PS serves on SERVER_THREADS threads (ps/main.py), of which
# at most MAX_WAITING_PULLS wait for a version at a time, each at most WAIT_SLICE_SECONDS;
# any other waiting pull is answered "not yet" at once (its own version, no parameters) and
# the client asks again with backoff (rpc/ps_client.py) until its own timeout. So at least
# 3/4 of the threads are always free for pushes and pulls, whatever the number of workers.
# Up to 16 sync workers wake the moment the version moves, as before; more poll, each poll
# holding a thread for about a ms (64 waiters: the first push answered in ~2 ms, every
# waiter awake within ~0.1 s; docs/consistency.md). A grpc.aio server would hold no thread
# while waiting, but would need an event loop in the PS and async interceptors.
SERVER_THREADS = 64
MAX_WAITING_PULLS = SERVER_THREADS // 4
WAIT_SLICE_SECONDS = 2.0

# Evaluation snapshots a PS keeps at most: a running round's, and one of a round lost to a PS
# restart whose drop did not arrive. Taking one more evicts the oldest (logged), so snapshots
# that were never dropped cannot grow the PS without bound.
MAX_SNAPSHOTS = 4


@dataclass(frozen=True)
class PSSettings:
    ps_id: int = 0
    num_ps: int = 1
    grads_to_wait: int = 1
    use_async: bool = False
    checkpoint_dir: str = ""
    checkpoint_steps: int = 0
    keep_checkpoint_max: int = 3
    checkpoint_dir_for_init: str = ""
    sync_version_tolerance: int = 0
    lr_staleness_modulation: bool = False
    minibatch_size: int = 0  # only to log the effective global batch size
    term: int = 0  # the leadership term of the master that started this PS (docs/elasticity.md)
    fence_floor: int = 0  # pushes of task hand-outs below it are refused (a relaunch after a rollback)
    # Restore the checkpoint's data position too: only within the run that made it (a relaunch,
    # a resumed job). A new job started from a checkpoint numbers its tasks afresh.
    restore_position: bool = False
    # A gradient whose norm is more than this many times the running norm is refused (0: never;
    # one beyond float32 always is): ps/gradient_guard.py.
    max_gradient_norm_ratio: float = DEFAULT_MAX_NORM_RATIO
    # --slice_dense_above_mb: how a restored checkpoint's large dense variables are sliced.
    slice_dense_above_mb: float = DEFAULT_SLICE_ABOVE_MB


class StaleTermError(ValueError):
    """A command from a master of an older leadership term: a deposed master must not act."""


def make_updating_strategy(settings: PSSettings) -> GradientUpdatingStrategy:
    if settings.use_async:
        return DirectUpdatingStrategy(settings.lr_staleness_modulation)
    return AverageUpdatingStrategy(
        settings.grads_to_wait, settings.sync_version_tolerance, settings.lr_staleness_modulation
    )


class ParameterServer(ShardCheckpoints, ShardLeveling, ShardReplication, ShardTables):
    def __init__(
        self,
        settings: PSSettings,
        optimizer: Optimizer,
        max_waiting_pulls: int = MAX_WAITING_PULLS,
        wait_slice: float = WAIT_SLICE_SECONDS,
        verifier: TicketVerifier | None = None,
    ):
        """``verifier``: the job key's (ps/main.py always gives one); with it, a push is taken
        only under a ticket the master signed for its task, hand-out, worker and records."""
        self.settings = settings
        self.verifier = verifier
        self.guard = GradientGuard(settings.max_gradient_norm_ratio)
        self.shard = ParameterShard(optimizer, ps_id=settings.ps_id, num_ps=settings.num_ps)
        self.strategy = make_updating_strategy(settings)
        self._lock = threading.Lock()
        self._version_changed = threading.Condition(self._lock)
        self._last_checkpoint_version = -1
        # Checkpoints are written off the lock (a copy taken under it), one at a time.
        self._checkpoint_lock = threading.Lock()
        self.checkpoint_failures = 0  # writes that failed (under the lock); the next one retries
        self.checkpoint_error = ""  # the last failure's message
        self._snapshots: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self._table_snapshots: dict[int, dict[str, FrozenTable]] = {}
        self._learning_rate: float | None = None  # set by the master (a LearningRateScheduler)
        self._logged_push_rate: float | None = None  # the last rate from a push that was logged
        self.max_waiting_pulls = max_waiting_pulls
        self.wait_slice = wait_slice
        self.waiting_pulls = 0  # pulls waiting for a version now (under the lock)
        self.pulls_told_not_yet = 0  # waiting pulls answered at once: every slot was taken
        self.position = DataPosition(fence_floor=settings.fence_floor)
        self.term = settings.term  # the newest leadership term heard of
        self._cut_at: int | None = None  # the master asked for a checkpoint at this version

    def restore(self) -> None:
        """Load --checkpoint_dir_for_init, if given (call before serving)."""
        if not self.settings.checkpoint_dir_for_init:
            return
        state = checkpoint.load_shard(
            self.settings.checkpoint_dir_for_init, self.settings.ps_id, self.settings.num_ps, self._slicing
        )
        if not self.settings.restore_position:
            state = dataclasses.replace(state, marks={}, records_applied=0)
        with self._lock:
            self._load_locked(state, self.settings.fence_floor)
        if self.settings.restore_position:  # this run's own timeline; a user's init is left alone
            self._discard_abandoned(state.version)
        logger.info(
            "restored %d variables (%d non-trainable) at version %d from %s (%d records applied)",
            len(state.params) + len(state.non_trainable), len(state.non_trainable), state.version,
            self.settings.checkpoint_dir_for_init, state.records_applied,
        )
        for name, table in state.embeddings.items():
            logger.info("restored %d rows of embedding table %s", len(table.ids), name)

    @property
    def _slicing(self) -> DenseSlicing:
        return DenseSlicing.from_flag(self.settings.slice_dense_above_mb, self.settings.num_ps)

    def _load_locked(self, state: checkpoint.ShardState, fence_floor: int) -> None:
        """Replace the whole shard by a checkpoint's (with the lock held)."""
        telemetry, live = self.strategy.telemetry, self.strategy.grads_to_wait
        self.shard = ParameterShard(self.shard.optimizer, ps_id=self.settings.ps_id, num_ps=self.settings.num_ps)
        self.shard.initialize({**state.params, **state.non_trainable}, state.version, state.non_trainable)
        self.shard.step = state.step
        for name, slots in state.slots.items():
            self.shard.slots[name].update(slots)
        self.shard.add_tables([table.info for table in state.embeddings.values()])
        for name, table in state.embeddings.items():
            self.shard.embeddings[name].load(table.ids, table.rows, table.slots, table.touched, table.meta,
                                             state.version)
        # A fresh strategy: a sync average in progress held gradients of the rolled-back records.
        self.strategy = make_updating_strategy(self.settings)
        self.strategy.telemetry = telemetry
        self.strategy.set_live_workers(self.shard, live)
        self.position.restore(state.marks, state.records_applied, fence_floor)
        self._snapshots.clear()
        self._table_snapshots.clear()
        self._cut_at = None
        self._last_checkpoint_version = state.version  # on disk already
        self._version_changed.notify_all()  # waiting pulls answer with the restored version

    def roll_back(self, path: str, term: int, fence_floor: int) -> int:
        """Go back to the checkpoint at ``path`` (a survivor, after another PS died): every PS
        then holds the same cut. Pushes of hand-outs below ``fence_floor`` are refused from now
        on. Returns the restored version. CheckpointError for a path outside --checkpoint_dir."""
        self.check_term(term)
        if not _under(path, self.settings.checkpoint_dir):
            raise checkpoint.CheckpointError(
                f"restore from {path!r} refused: it is not a checkpoint under this job's --checkpoint_dir "
                f"{self.settings.checkpoint_dir!r}"
            )
        state = checkpoint.load_shard(path, self.settings.ps_id, self.settings.num_ps, self._slicing)
        with self._checkpoint_lock, self._lock:
            before = self.shard.version
            self._load_locked(state, fence_floor)
        self._discard_abandoned(state.version)
        logger.warning("rolled back from version %d to the checkpoint at version %d (%s): the job trains the "
                       "records after it again", before, state.version, path)
        return state.version

    def _discard_abandoned(self, version: int) -> None:
        """This shard's checkpoint files after the restored version belong to a timeline that is
        gone; removed so that they never make a cut with the new timeline's files."""
        if not self.settings.checkpoint_dir:
            return
        directory = self.settings.checkpoint_dir  # only this lineage's files (model/checkpoint_owner.py)
        for path in checkpoint.discard_after(directory, version, self.settings.ps_id, self.term,
                                             lineage_floor(directory, self.term)):
            logger.info("removed %s: written after the checkpoint the job went back to", path)

    def fence(self, handouts: list[int], task_ids: list[int], term: int, done_below: int = 0) -> dict[int, int]:
        """Refuse pushes of ``handouts`` from now on; how far each of ``task_ids`` was taken.
        ``done_below``: a stream's tasks below it are done and folded (their marks go, data_position.py)."""
        self.check_term(term)
        with self._lock:
            self.position.fence(handouts)
            self.position.compact(done_below)
            marks = {task_id: self.position.accepted_mark(task_id) for task_id in task_ids}
            entry = self._replicate_locked("fence", handouts, task_ids, term, done_below)
        self._deliver(entry)
        return marks

    def check_term(self, term: int) -> None:
        """StaleTermError for a command of an older term; a newer one is adopted."""
        with self._lock:
            if term < self.term:
                raise StaleTermError(
                    f"a command from leadership term {term} refused: this PS serves term {self.term} "
                    "(another master took over the job)"
                )
            self.term = term

    def checkpoint_at(self, version: int, term: int) -> str:
        """Save when the shard reaches ``version`` (the same on every PS: one cut). Returns the path
        when saved now, '' when armed for later, and raises CheckpointError when already past it."""
        self.check_term(term)
        with self._lock:
            if not self.settings.checkpoint_dir or not self.shard.initialized:
                return ""
            if version < self.shard.version:
                raise checkpoint.CheckpointError(
                    f"a checkpoint at version {version} was asked, this PS is at {self.shard.version} already"
                )
            if version > self.shard.version:
                self._cut_at = version
                return ""
            state = self._copy_locked()
        return self._write_checkpoint(state)

    def push_model(self, params: dict[str, np.ndarray], version: int = 0, non_trainable=()) -> tuple[bool, int]:
        """Take the first model; ``non_trainable``: the names among ``params`` that are
        non-trainable state (changed by pushed changes, not by gradients)."""
        with self._lock:
            accepted = self.shard.initialize(params, version, non_trainable)
            entry = None
            if accepted:
                logger.info("initialized with %d variables (%d non-trainable) at version %d", len(params),
                            len(self.shard.non_trainable), version)
                entry = self._replicate_locked("model", params, version, non_trainable)
            answer = accepted, self.shard.version
        self._deliver(entry)
        return answer

    def take_snapshot(self, snapshot_id: int) -> int:
        """Freeze a copy of the parameters for an evaluation; returns its version.

        At most MAX_SNAPSHOTS are kept: one more evicts the oldest (taking an id again replaces it).
        """
        with self._lock:
            self._snapshots.pop(snapshot_id, None)
            self._table_snapshots.pop(snapshot_id, None)
            while len(self._snapshots) >= MAX_SNAPSHOTS:
                oldest = next(iter(self._snapshots))
                del self._snapshots[oldest]
                self._table_snapshots.pop(oldest, None)
                logger.warning(
                    "evicted evaluation snapshot %d: this PS keeps at most %d (was it never dropped?)",
                    oldest, MAX_SNAPSHOTS,
                )
            params = {n: v.copy() for n, v in self.shard.params.items()}
            self._snapshots[snapshot_id] = (self.shard.version, params)
            self._table_snapshots[snapshot_id] = {n: t.frozen() for n, t in self.shard.embeddings.items()}
            return self.shard.version

    def drop_snapshot(self, snapshot_id: int) -> None:
        with self._lock:
            self._snapshots.pop(snapshot_id, None)
            self._table_snapshots.pop(snapshot_id, None)

    def pull_snapshot(self, snapshot_id: int) -> tuple[bool, int, dict[str, np.ndarray]]:
        with self._lock:
            if snapshot_id not in self._snapshots:
                raise KeyError(f"no snapshot {snapshot_id} on this PS (already dropped?)")
            version, params = self._snapshots[snapshot_id]
            return True, version, params

    def set_learning_rate(self, learning_rate: float | None, term: int = 0) -> None:
        """The master's rate for pushes that bring none (None: the optimizer's own).
        ValueError for a rate that is not finite, negative or too large (state unchanged; 0 is a
        rate: pushes then change nothing);
        StaleTermError from a master of an older term."""
        problem = learning_rate_problem(learning_rate) if learning_rate is not None else ""
        if problem:
            raise ValueError(problem)
        self.check_term(term)
        with self._lock:
            before, self._learning_rate = self._learning_rate, learning_rate
            entry = self._replicate_locked("learning_rate", learning_rate, term)
        self._deliver(entry)
        logger.info(
            "learning rate set to %s by the master (was %s)",
            _rate(learning_rate), _rate(before),
        )

    def pull(
        self, worker_version: int, wait_for_newer: bool = False, timeout: float = 0.0, encode=None
    ):
        """(initialized, version, params); params are empty when the worker is current.

        With ``wait_for_newer`` the call blocks (up to ``timeout`` seconds, at most
        ``wait_slice``) while the model is still at ``worker_version``: a sync worker waits
        there for the others' gradients. When ``max_waiting_pulls`` pulls wait already, it
        answers at once instead: the model is still at ``worker_version``, ask again (see
        MAX_WAITING_PULLS). A timeout that is not a positive number waits for nothing.
        With ``encode``, returns ``encode(initialized, version, params)``, called under the
        lock on the live arrays: serializing them is then their only copy.
        """
        with self._lock:
            if wait_for_newer and timeout > 0 and self.shard.version == worker_version:
                if self.waiting_pulls < self.max_waiting_pulls:
                    self.waiting_pulls += 1
                    try:
                        self._version_changed.wait_for(
                            lambda: self.shard.version != worker_version, min(timeout, self.wait_slice)
                        )
                    finally:
                        self.waiting_pulls -= 1
                else:
                    self.pulls_told_not_yet += 1
            if not self.shard.initialized:
                answer = False, self.shard.version, {}
            elif worker_version == self.shard.version:
                answer = True, self.shard.version, {}
            elif encode is not None:
                answer = True, self.shard.version, self.shard.params
            else:  # copies: the arrays change under the lock once it is released
                answer = True, self.shard.version, {n: v.copy() for n, v in self.shard.params.items()}
            return encode(*answer) if encode is not None else answer

    def push_gradients(
        self, grads: dict[str, np.ndarray], version: int, learning_rate: float | None, encode=None,
        batch: BatchPosition | None = None, worker_id: int = 0,
    ):
        """The PushResult; with ``encode``, ``encode(result, params)`` called under the lock, where
        ``params`` are the live parameters when this push made a new version, else None.
        ``batch``: where the gradient's records are (a training task's push), and ``worker_id``
        the worker that names it (its ticket must be for that worker)."""
        due = entry = None
        with self._lock:
            try:
                if self.shard.initialized:  # an empty one holds nothing to check against (below)
                    self.shard.check_gradients(grads)
                check_push(version, learning_rate, batch, worker_id, self.verifier)
            except EmbeddingError as err:  # bad ids or rows: the servicer answers INVALID_ARGUMENT
                logger.warning("rejected push: %s", err)
                self.strategy.telemetry.pushes_rejected_invalid += 1
                raise
            except GradientError as err:
                logger.warning("rejected push: %s", err)
                self.strategy.telemetry.pushes_rejected_invalid += 1
                result = PushResult(PushOutcome.REJECTED_INVALID, self.shard.version, str(err))
            else:
                if batch is not None and self.position.refused(batch):
                    result = PushResult(PushOutcome.REJECTED_FENCED, self.shard.version,
                                        f"task {batch.task_id} was taken back by the master (hand-out "
                                        f"{batch.handout} fenced): leave it")
                elif batch is not None and self.position.already_taken(batch):
                    # A retry of a push whose answer was lost: taken once already.
                    result = PushResult(PushOutcome.APPLIED, self.shard.version, "already applied")
                elif not self.shard.initialized:
                    # Relaunched empty (no checkpoint, or its cut was damaged) while the worker was
                    # away (frozen): the gradient was computed on no model this PS holds. Stale, so
                    # the worker pulls, which gives the PS its copy, and computes again; refused as
                    # invalid, the task failed until dropped (simulator, seed 2438).
                    self.strategy.telemetry.rejected_stale(self.shard.version)
                    result = PushResult(PushOutcome.REJECTED_STALE, self.shard.version,
                                        "the parameter server holds no model (it restarted empty): pull, which "
                                        "gives it the worker's copy, and compute again")
                elif refusal := self.guard.problem(grads):
                    logger.warning("rejected push of worker %d: %s", worker_id, refusal)
                    self.strategy.telemetry.pushes_rejected_invalid += 1
                    result = PushResult(PushOutcome.REJECTED_INVALID, self.shard.version, refusal)
                else:
                    result, due = self._push_locked(grads, version, learning_rate, batch)
                    if result.accepted:
                        self.guard.passed()
                        entry = self._replicate_locked("push", grads, version, learning_rate, batch, worker_id)
            reply = result if encode is None else encode(result, self.shard.params if result.applied else None)
        self._deliver(entry)  # answered once every backup took it (docs/replicas.md)
        self._write_due_checkpoint(due)  # off the lock; never fails the push, which was applied
        return reply

    def _push_locked(self, grads, version, learning_rate, batch):
        before = self.shard.version
        if learning_rate is None:
            learning_rate = self._learning_rate
        else:
            self._log_push_rate(learning_rate)
        result = self.strategy.push(self.shard, grads, version, learning_rate)
        if result.accepted and batch is not None:
            self.position.accepted(batch)
        due = self._on_new_version() if self.shard.version != before else None
        return result, due

    def _log_push_rate(self, learning_rate: float) -> None:
        """Log a worker's rate when it moved by 10% or more since the one last logged: each step
        of a schedule, without a line per push for a rate that decays a little every version."""
        logged = self._logged_push_rate
        if logged is None or (learning_rate != logged and abs(learning_rate - logged) >= 0.1 * logged):
            logger.info("learning rate %g from the workers' schedule (was %s)", learning_rate, _rate(logged))
            self._logged_push_rate = learning_rate

    def set_live_workers(self, count: int) -> None:
        """The master's count of workers holding a task (sync mode adapts grads_to_wait)."""
        due = None
        with self._lock:
            before_wait, before_version = self.strategy.grads_to_wait, self.shard.version
            self.strategy.set_live_workers(self.shard, count)
            if self.strategy.grads_to_wait != before_wait:
                logger.info(
                    "%d workers hold a task: %d gradients per version (was %d), "
                    "effective global batch size %d",
                    count, self.strategy.grads_to_wait, before_wait,
                    self.strategy.grads_to_wait * self.settings.minibatch_size,
                )
            if self.shard.version != before_version:
                due = self._on_new_version()
            entry = (self._replicate_locked("live_workers", count)
                     if (self.strategy.grads_to_wait, self.shard.version) != (before_wait, before_version) else None)
        self._deliver(entry)
        self._write_due_checkpoint(due)

    def stats(self) -> tuple[int, UpdateTelemetry, int]:
        """(version, telemetry totals, grads_to_wait): a consistent snapshot for the master.

        The per-version table is left out: the master polls this often.
        """
        with self._lock:
            t = self.strategy.telemetry
            totals = UpdateTelemetry(
                t.pushes_accepted, t.pushes_rejected_stale, t.pushes_rejected_invalid, copy.copy(t.staleness)
            )
            return self.shard.version, totals, self.strategy.grads_to_wait

def _under(path: str, root: str) -> bool:
    """True if ``path`` lies inside the directory ``root`` (local or an object store's prefix)."""
    if not root:
        return False
    if fs.is_remote(root):
        parts = path.split("/")
        return path.startswith(root.rstrip("/") + "/") and ".." not in parts
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def _rate(learning_rate: float | None) -> str:
    return "the optimizer's own" if learning_rate is None else f"{learning_rate:g}"
