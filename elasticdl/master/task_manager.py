"""The master's task ledger: todo / doing / done per epoch.

A task is a record range of one file. Workers take tasks (``get_task``) and report them
(``report``); a task in doing longer than ``task_timeout`` goes back to todo with its
retry count + 1, and past ``max_task_retries`` it is dropped and reported. A dead
worker's tasks go back to todo without counting against them. When todo and doing are
both empty the next epoch starts, with the tasks reshuffled; after ``num_epochs`` the
job is finished.

Exactly once: every hand-out of a task gets a number (``handout``), which the worker's
pushes carry. When the ledger takes a task back from a worker (it died, failed or timed
out), the hand-out waits to be *fenced* on the PS (``pending_fences``: the controller decides
``FenceHandouts``, the job asks the PS and answers with ``fenced``): the PS refuse its pushes
from then on and answer how far the task's records were applied. Only the rest goes back to
todo, so no batch is applied twice. The ledger itself never calls out. A rollback to a checkpoint (``rewind``) puts every record the
checkpoint does not hold back to todo, in this epoch and the one before.

Read-ahead: with each task a worker is promised the task it gets next (``read_ahead``), and
reads that task's records while it trains this one, so it does not wait on the network
between tasks. A promised task stays in todo (the ledger does not change); it goes to the
worker it was promised to, and to another only when every task left is promised to someone.

Pure Python: no lock, no clock of its own, no call out. In a job only the job loop's thread
calls it (the workers' requests are served there: elasticdl/master/request_desk.py); tests
and the simulator drive it directly, with their own clock.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Sequence

from elasticdl.data.sources import Shard
from elasticdl.master.ledger_persistence import LedgerPersistence
from elasticdl.master.promises import ReadAheadPromises
from elasticdl.master.tasks import Doing, EpochStats, Fencing, NoTask, ReportOutcome, Task, TaskType

__all__ = ["EpochStats", "NoTask", "ReportOutcome", "Task", "TaskManager", "TaskType"]

logger = logging.getLogger(__name__)


class TaskManager(LedgerPersistence):
    # A stream's ledger (elasticdl/master/stream_tasks.py) starts empty: its tasks come as records arrive.
    _open_ended = False

    def __init__(
        self,
        shards: Sequence[Shard],
        num_epochs: int = 1,
        task_timeout: float = 600.0,
        max_task_retries: int = 3,
        seed: int = 0,
        task_type: TaskType = TaskType.TRAINING,
        shuffle: bool = True,
        clock: Callable[[], float] | None = None,
        first_task_id: int = 0,
        gate_epochs: bool = False,
        fences_pushes: bool = False,
    ):
        if not shards and not self._open_ended:
            raise ValueError("no records to train on: every data file is empty")
        self._shards = list(shards)
        self._num_epochs = num_epochs
        self._task_timeout = task_timeout
        self._max_task_retries = max_task_retries
        self._seed = seed
        self._task_type = task_type
        self._shuffle = shuffle
        # What tasks are held against --task_timeout: the job's monotonic clock, the simulator's
        # simulated one. Without (unit tests), no task ever times out.
        self._clock = clock or _no_time
        self._next_id = first_task_id
        self._stopped = False
        # With gate_epochs, epoch N+1's tasks are handed out only once the master opened it
        # (``open_epoch``): its end is handled first (the evaluation snapshot, and, with an
        # EarlyStopping callback, the epoch's evaluation and callbacks). None: no gate.
        self._opened: int | None = 0 if gate_epochs else None
        self.seq = 0  # bumped by every change: the job loop saves the ledger when it moves
        self._todo: deque[Task] = deque()
        self._doing: dict[int, Doing] = {}
        self._done: dict[int, Task] = {}  # this epoch's and the last one's: what a rollback may undo
        self._next_handout = 1
        self._promises = ReadAheadPromises()  # see above: each promised task is in todo
        # Workers whose task timed out since the controller last asked (``take_stalled``): a
        # worker that stops making progress is replaced, not waited for.
        self._stalled: set[int] = set()
        # Hand-out -> a training task taken back whose pushes are not fenced yet: it is neither
        # in todo nor in doing, and its epoch is not over.
        self._fencing: dict[int, Fencing] = {}
        # Training pushes carry hand-outs the PS can fence (the job's training ledger): a task
        # taken back waits for its fence. Without, it goes back to todo at once, all of it.
        self.fences_pushes = fences_pushes
        self.epochs: list[EpochStats] = []
        self._start_epoch(0)

    # ------------------------------------------------------------ workers

    def get_task(self, worker_id: int) -> Task | NoTask:
        self._requeue_timed_out()
        if not self._todo and not self._in_flight:
            if self._gate_closed():
                return NoTask.WAIT  # the master is still handling the end of this epoch
            if not self._advance_epoch():
                return NoTask.END
        if not self._todo:
            return NoTask.WAIT
        task = self._promises.take_for(self._todo, worker_id)
        self._promises.promise_next(self._todo, worker_id)
        task.handout = self._next_handout
        self._next_handout += 1
        if task.requeued:
            task.requeued = False
            logger.info("requeued task %d now runs on worker %d", task.task_id, worker_id)
        self._doing[task.task_id] = Doing(task, worker_id, self._clock())
        self._bump()
        return task

    def read_ahead(self, worker_id: int) -> Shard | None:
        """The records of the task ``worker_id`` gets next (None: none is left to promise)."""
        task = self._promises.of(worker_id)
        return None if task is None else task.shard

    def report(
        self,
        task_id: int,
        worker_id: int,
        err_message: str = "",
        records: int | None = None,
        interrupted: bool = False,
        handout: int = 0,
    ) -> ReportOutcome:
        """A worker's result for a task; unknown, foreign or impossible reports change nothing.

        Only the worker holding the task may report it. ``records`` is never negative, and
        never more than the task holds for a training task, a failure or an interruption
        (there it counts the task's records; an evaluation or prediction counts the examples
        ``dataset_fn`` made of them, which may be more).
        ``interrupted``: the worker was told to leave after training the task's first
        ``records`` records; only the rest goes back to todo.
        """
        doing = self._doing.get(task_id)
        if doing is None:
            reason = f"task {task_id} is not in progress (unknown, already reported or requeued)"
            logger.warning("ignored report from worker %d: %s", worker_id, reason)
            return ReportOutcome(False, reason)
        if doing.worker_id != worker_id:
            reason = f"task {task_id} is assigned to worker {doing.worker_id}, not {worker_id}"
            logger.warning("ignored report: %s", reason)
            return ReportOutcome(False, reason)
        if handout and handout != doing.task.handout:
            reason = f"task {task_id} was taken back from hand-out {handout} (rollback); it runs as {doing.task.handout}"
            logger.info("ignored report from worker %d: %s", worker_id, reason)
            return ReportOutcome(False, reason)
        task = doing.task
        counts_records = task.type is TaskType.TRAINING or err_message or interrupted
        if records is not None and (records < 0 or (counts_records and records > task.records)):
            reason = (
                f"report for task {task_id} with {records} records: the task has {task.records}, "
                "and a worker reports between 0 and that many"
            )
            logger.warning("ignored report from worker %d: %s", worker_id, reason)
            return ReportOutcome(False, reason)
        if interrupted and not err_message and (records is None or not 0 <= records <= task.records):
            reason = f"interrupted report for task {task_id} with {records} records (the task has {task.records})"
            logger.warning("ignored report from worker %d: %s", worker_id, reason)
            return ReportOutcome(False, reason)
        del self._doing[task_id]
        self._bump()
        stats = self.epochs[task.epoch]
        if err_message:
            self._take_back(doing, "task failed", max(doing.progress, records or 0),
                            f"worker {worker_id} failed it: {err_message}")
            return ReportOutcome(True)
        if interrupted:
            stats.records_done += records
            stats.interrupted("worker left")
            self._done[task_id] = Task(task_id, task.type, Shard(task.shard.path, task.shard.start,
                                       task.shard.start + records), task.epoch, origin=task.origin)
            if records < task.records and not self._stopped:
                rest = Shard(task.shard.path, task.shard.start + records, task.shard.end)
                self._todo.appendleft(Task(self._next_id, task.type, rest, task.epoch, task.retries))
                self._next_id += 1
                logger.info(
                    "worker %d left task %d after %d of %d records; requeued records %d-%d",
                    worker_id, task_id, records, task.records, rest.start, rest.end,
                )
            return ReportOutcome(True)
        stats.records_done += task.records if records is None else records
        stats.tasks_done += 1
        if task.type is TaskType.TRAINING:
            self._done[task_id] = task
        return ReportOutcome(True)

    def progress(self, task_id: int, worker_id: int, records_done: int) -> ReportOutcome:
        """How far a worker got in its task (counted as trained twice if it dies now).

        Refused (nothing changes) unless the worker holds the task and 0 <= records_done <= its size.
        """
        doing = self._doing.get(task_id)
        if doing is None or doing.worker_id != worker_id:
            holder = "nobody" if doing is None else f"worker {doing.worker_id}"
            return ReportOutcome(False, f"task {task_id} is held by {holder}, not by worker {worker_id}")
        if not 0 <= records_done <= doing.task.records:
            return ReportOutcome(
                False, f"progress of {records_done} records for task {task_id}, which has {doing.task.records}"
            )
        doing.progress = max(doing.progress, records_done)
        return ReportOutcome(True)

    def stop(self) -> int:
        """Stop early (EarlyStopping): drop the tasks not started, start no new epoch.

        Tasks in progress still finish. Returns how many tasks were dropped from todo.
        """
        dropped = len(self._todo)
        self._todo.clear()
        self._promises.end()
        self._stopped = True
        self._bump()
        return dropped

    def open_epoch(self, epoch: int) -> None:
        """Let epoch ``epoch``'s tasks be handed out (``gate_epochs``; a no-op without the gate)."""
        if self._opened is not None and epoch > self._opened:
            self._opened = epoch
            self._bump()

    @property
    def between_epochs(self) -> bool:
        """Every task of the current epoch is done and the next one has not started."""
        return not self._todo and not self._in_flight

    def recover_worker_tasks(self, worker_id: int) -> list[Task]:
        """Put a dead worker's in-progress tasks back at the front of todo: the records its
        pushes did not apply (the PS say which, see ``fenced``)."""
        gone = [d for d in self._doing.values() if d.worker_id == worker_id]
        mine = [d.task for d in gone]
        self._promises.end(worker_id)
        self.seq += bool(gone)
        for doing in gone:
            del self._doing[doing.task.task_id]
            self._take_back(doing, "worker died", doing.progress)
        if gone:
            logger.info("worker %d is gone; requeued tasks %s (what the PS did not apply, once fenced)", worker_id,
                        [t.task_id for t in mine])
        return mine

    def fence_all(self) -> int:
        """A number above every hand-out made so far: the fence of a rollback."""
        floor = self._next_handout
        self._next_handout += 1
        return floor

    def start_term(self, term: int) -> None:
        """Hand-outs of leadership term ``term`` are numbered from ``term << 32``: above any of an
        older term, so a PS fenced at the new term's start refuses the old master's workers."""
        self._next_handout = max(self._next_handout, (term << 32) + 1)

    def rewind(self, marks: dict[int, int], cause: str = "rollback") -> int:
        """The model went back to a checkpoint whose data position is ``marks`` (task id -> records
        applied up to that index). Every record after it goes back to todo: done, doing and todo
        tasks of this epoch and the last one. Returns the records to train again."""
        again = 0
        # (task, records of it credited as done, records of it trained, was it done)
        tasks = [(t, t.shard.end - t.origin, t.shard.end - t.origin, True) for t in self._done.values()]
        tasks += [(d.task, d.task.shard.start - d.task.origin, d.task.shard.start - d.task.origin + d.progress,
                   False) for d in self._in_flight]
        tasks += [(t, t.shard.start - t.origin, t.shard.start - t.origin, False) for t in self._todo]
        todo: list[Task] = []
        done: dict[int, Task] = {}
        for task, credited, trained, was_done in tasks:
            applied = min(max(marks.get(task.task_id, task.origin), task.origin), task.shard.end)
            stats = self.epochs[task.epoch]
            lost = trained - (applied - task.origin)
            if lost > 0:
                stats.interrupted(cause)
                stats.count_retrained(cause, lost)
                again += lost
            stats.records_done += applied - task.origin - credited
            if applied >= task.shard.end:
                done[task.task_id] = task
                stats.tasks_done += not was_done
                continue
            stats.tasks_done -= was_done
            todo.append(Task(task.task_id, task.type, Shard(task.shard.path, applied, task.shard.end),
                             task.epoch, task.retries, origin=task.origin))
        self._done = done
        self._doing.clear()
        self._fencing.clear()  # the rollback fenced every hand-out (fence_all): late answers are ignored
        self._todo = deque(sorted(todo, key=lambda t: t.epoch))  # stable: the order within an epoch stays
        self._promises.end()
        self._bump()
        logger.warning("went back to the checkpoint's data position: %d records go back to todo (%s)",
                       again, cause)
        return again

    def _take_back(self, doing: Doing, cause: str, progress: int, retry_why: str = "") -> None:
        """Take a task back from its worker. A training hand-out is fenced on the
        PS first (``pending_fences``); anything else goes back at once (``retry_why``: counted as
        a retry for that reason; "": to the front of todo, as a dead worker's)."""
        self.epochs[doing.task.epoch].interrupted(cause)
        fencing = Fencing(doing, cause, progress, retry_why)
        if self.fences_pushes and doing.task.type is TaskType.TRAINING and doing.task.handout:
            self._fencing[doing.task.handout] = fencing
        else:
            self._requeue_rest(fencing, None)

    def pending_fences(self) -> tuple[list[int], list[int]]:
        """(hand-outs, their task ids) taken back and not yet asked to be fenced; now asked."""
        asked = [f for f in self._fencing.values() if not f.asked]
        for fencing in asked:
            fencing.asked = True
        return [f.doing.task.handout for f in asked], [f.doing.task.task_id for f in asked]

    def fenced(self, handouts: list[int], marks: dict[int, int] | None) -> None:
        """The PS refuse ``handouts`` from now on and applied each task's records up to
        ``marks[task_id]`` (None: a PS could not be asked, the whole attempt is trained again).
        The rest of each task goes back to todo. Hand-outs no longer fencing (a rollback took
        every task back meanwhile) are ignored."""
        for handout in handouts:
            fencing = self._fencing.pop(handout, None)
            if fencing is not None:
                self._requeue_rest(fencing, marks)
        self._bump()

    def _requeue_rest(self, fencing: Fencing, marks: dict[int, int] | None) -> None:
        rest = self._rest_after(fencing.doing, fencing.cause, fencing.progress, marks)
        if rest is None:
            logger.info("task %d: the PS had applied all of it: it is done", fencing.doing.task.task_id)
        elif fencing.retry_why:
            self._retry(rest, fencing.retry_why)
        elif not self._stopped:
            rest.requeued = True
            self._todo.appendleft(rest)

    def _rest_after(self, doing: Doing, cause: str, progress: int, marks: dict[int, int] | None) -> Task | None:
        """The task for the records the PS did not apply (None when all were: it is done)."""
        task = doing.task
        stats = self.epochs[task.epoch]
        if marks is None:  # the PS could not be asked: whatever was pushed is trained again
            stats.count_retrained(cause, progress)
            return task
        applied = min(max(marks.get(task.task_id, task.origin), task.shard.start), task.shard.end)
        stats.count_retrained(cause, task.shard.start + progress - applied)
        if applied >= task.shard.end:
            stats.records_done += task.shard.end - task.shard.start
            stats.tasks_done += 1
            self._done[task.task_id] = task
            return None
        if applied > task.shard.start:
            logger.info("task %d: records %d-%d were applied before it was taken back; %d-%d go back to todo",
                        task.task_id, task.shard.start, applied - 1, applied, task.shard.end - 1)
            stats.records_done += applied - task.shard.start
        return Task(task.task_id, task.type, Shard(task.shard.path, applied, task.shard.end), task.epoch,
                    task.retries, origin=task.origin)

    # ------------------------------------------------------------ state

    @property
    def epoch(self) -> int:
        return len(self.epochs) - 1

    @property
    def finished(self) -> bool:
        return not self._todo and not self._in_flight and (self._stopped or self.epoch + 1 >= self._num_epochs)

    @property
    def num_epochs(self) -> int:
        return self._num_epochs

    @property
    def records_per_epoch(self) -> int:
        return sum(s.records for s in self._shards)

    def counts(self) -> tuple[int, int]:
        """(todo, doing) task counts."""
        return len(self._todo), len(self._doing)

    def active_workers(self) -> set[int]:
        """Workers holding a task now."""
        return {d.worker_id for d in self._doing.values()}

    def dropped_tasks(self) -> list[Task]:
        return [t for e in self.epochs for t in e.dropped]

    # ------------------------------------------------------------ internals

    def _start_epoch(self, epoch: int) -> None:
        shards = list(self._shards)
        if self._shuffle:
            # A fresh generator per epoch: a master resuming from a ledger shuffles the same way.
            random.Random(f"{self._seed}-{epoch}").shuffle(shards)
        for shard in shards:
            self._todo.append(Task(self._next_id, self._task_type, shard, epoch))
            self._next_id += 1
        self._done = {i: t for i, t in self._done.items() if t.epoch >= epoch - 1}
        self.epochs.append(EpochStats(epoch, sum(s.records for s in shards)))
        self._bump()

    @property
    def _in_flight(self) -> list[Doing]:
        """Attempts not over: held by a worker, or taken back and not fenced yet."""
        return [*self._doing.values(), *(f.doing for f in self._fencing.values())]

    def _bump(self) -> None:
        """A change: the ledger moved (the job saves it; a request waiting for a task looks again)."""
        self.seq += 1

    def _gate_closed(self) -> bool:
        return (self._opened is not None and not self._stopped and self.epoch + 1 < self._num_epochs
                and self.epoch + 1 > self._opened)

    def _advance_epoch(self) -> bool:
        if self._stopped or self.epoch + 1 >= self._num_epochs:
            return False
        self._start_epoch(self.epoch + 1)
        logger.info("epoch %d of %d starts", self.epoch + 1, self._num_epochs)
        return True

    @property
    def task_timeout(self) -> float:
        return self._task_timeout

    def requeue_timed_out(self) -> None:
        """Take back the tasks held past ``task_timeout`` (the controller asks at every Tick: with
        every worker frozen, nobody else would ask for a task and so time one out)."""
        self._requeue_timed_out()

    def take_stalled(self) -> list[int]:
        """The workers whose task timed out since the last call."""
        stalled, self._stalled = sorted(self._stalled), set()
        return stalled

    def _requeue_timed_out(self) -> None:
        now = self._clock()
        late = [d for d in self._doing.values() if now - d.started > self._task_timeout]
        for doing in late:
            self._stalled.add(doing.worker_id)
            self._bump()
            del self._doing[doing.task.task_id]
            self._take_back(doing, "timeout", doing.progress,
                            f"worker {doing.worker_id} held it longer than --task_timeout={self._task_timeout:g}s")

    def _retry(self, task: Task, why: str) -> None:
        task.retries += 1
        task.last_error = why
        stats = self.epochs[task.epoch]
        if task.retries > self._max_task_retries:
            stats.dropped.append(task)
            logger.error(
                "dropped task %d (%s records %d-%d) after %d tries; last: %s. "
                "Raise --max_task_retries or fix the cause.",
                task.task_id, task.shard.path, task.shard.start, task.shard.end, task.retries, why,
            )
            return
        stats.tasks_retried += 1
        logger.warning("task %d back to todo (try %d): %s", task.task_id, task.retries + 1, why)
        self._todo.appendleft(task)


def _no_time() -> float:
    return 0.0
