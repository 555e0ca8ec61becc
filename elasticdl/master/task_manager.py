"""The master's task ledger: todo / doing / done per epoch.

A task is a record range of one file. Workers take tasks (``get_task``) and report them
(``report``); a task in doing longer than ``task_timeout`` goes back to todo with its
retry count + 1, and past ``max_task_retries`` it is dropped and reported. A dead
worker's tasks go back to todo without counting against them. When todo and doing are
both empty the next epoch starts, with the tasks reshuffled; after ``num_epochs`` the
job is finished.

Pure Python and thread-safe; the clock is injectable so tests drive timeouts directly.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from elasticdl.data.sources import Shard
from elasticdl.store.ledger import EpochRecord, LedgerSnapshot, TaskRecord, TaskState

logger = logging.getLogger(__name__)


class TaskType(enum.StrEnum):
    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"


class NoTask(enum.Enum):
    """What ``get_task`` returns when it has no task to give."""

    WAIT = "wait"  # others hold the remaining tasks; one may come back
    END = "end"  # the job is finished


@dataclass
class Task:
    task_id: int
    type: TaskType
    shard: Shard
    epoch: int
    retries: int = 0
    snapshot_id: int = 0  # evaluation: the PS snapshot to evaluate
    model_version: int = -1  # evaluation: the version that snapshot holds
    requeued: bool = False  # back in todo after its worker died (logged when handed out again)
    last_error: str = ""  # why its last try failed (a dropped task fails the job with it)

    @property
    def records(self) -> int:
        return self.shard.records


@dataclass
class _Doing:
    task: Task
    worker_id: int
    started: float
    progress: int = 0  # records of this attempt trained so far (the worker's progress reports)


@dataclass(frozen=True)
class ReportOutcome:
    accepted: bool
    reason: str = ""


@dataclass
class EpochStats:
    epoch: int
    records_total: int
    records_done: int = 0
    tasks_done: int = 0
    tasks_retried: int = 0
    tasks_interrupted: int = 0  # preempted workers' tasks, split into done and requeued
    # Records of attempts that did not complete (worker killed, failed, timed out) and are
    # trained again: the price of a hard failure. A graceful preemption adds nothing.
    records_trained_twice: int = 0
    dropped: list[Task] = field(default_factory=list)


class TaskManager:
    def __init__(
        self,
        shards: Sequence[Shard],
        num_epochs: int = 1,
        task_timeout: float = 600.0,
        max_task_retries: int = 3,
        seed: int = 0,
        task_type: TaskType = TaskType.TRAINING,
        shuffle: bool = True,
        clock: Callable[[], float] = time.monotonic,
        first_task_id: int = 0,
    ):
        if not shards:
            raise ValueError("no records to train on: every data file is empty")
        self._shards = list(shards)
        self._num_epochs = num_epochs
        self._task_timeout = task_timeout
        self._max_task_retries = max_task_retries
        self._seed = seed
        self._task_type = task_type
        self._shuffle = shuffle
        self._clock = clock
        self._lock = threading.Lock()
        self._next_id = first_task_id
        self._stopped = False
        self.seq = 0  # bumped by every change: the job loop saves the ledger when it moves
        self._todo: deque[Task] = deque()
        self._doing: dict[int, _Doing] = {}
        self.epochs: list[EpochStats] = []
        self._start_epoch(0)

    # ------------------------------------------------------------ workers

    def get_task(self, worker_id: int) -> Task | NoTask:
        with self._lock:
            self._requeue_timed_out()
            if not self._todo and not self._doing:
                if not self._advance_epoch():
                    return NoTask.END
            if not self._todo:
                return NoTask.WAIT
            task = self._todo.popleft()
            if task.requeued:
                task.requeued = False
                logger.info("requeued task %d now runs on worker %d", task.task_id, worker_id)
            self._doing[task.task_id] = _Doing(task, worker_id, self._clock())
            self.seq += 1
            return task

    def report(
        self,
        task_id: int,
        worker_id: int,
        err_message: str = "",
        records: int | None = None,
        interrupted: bool = False,
    ) -> ReportOutcome:
        """A worker's result for a task; unknown, foreign or impossible reports change nothing.

        Only the worker holding the task may report it. ``records`` is never negative, and
        never more than the task holds for a training task, a failure or an interruption
        (there it counts the task's records; an evaluation or prediction counts the examples
        ``dataset_fn`` made of them, which may be more).
        ``interrupted``: the worker was told to leave after training the task's first
        ``records`` records; only the rest goes back to todo.
        """
        with self._lock:
            doing = self._doing.get(task_id)
            if doing is None:
                reason = f"task {task_id} is not in progress (unknown, already reported or requeued)"
                logger.warning("ignored report from worker %d: %s", worker_id, reason)
                return ReportOutcome(False, reason)
            if doing.worker_id != worker_id:
                reason = f"task {task_id} is assigned to worker {doing.worker_id}, not {worker_id}"
                logger.warning("ignored report: %s", reason)
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
            self.seq += 1
            stats = self.epochs[task.epoch]
            if err_message:
                stats.records_trained_twice += max(doing.progress, records or 0)
                self._retry(task, f"worker {worker_id} failed it: {err_message}")
                return ReportOutcome(True)
            if interrupted:
                stats.records_done += records
                stats.tasks_interrupted += 1
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
            return ReportOutcome(True)

    def progress(self, task_id: int, worker_id: int, records_done: int) -> ReportOutcome:
        """How far a worker got in its task (counted as trained twice if it dies now).

        Refused (nothing changes) unless the worker holds the task and 0 <= records_done <= its size.
        """
        with self._lock:
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
        with self._lock:
            dropped = len(self._todo)
            self._todo.clear()
            self._stopped = True
            self.seq += 1
            return dropped

    def recover_worker_tasks(self, worker_id: int) -> list[Task]:
        """Put a dead worker's in-progress tasks back at the front of todo."""
        with self._lock:
            gone = [d for d in self._doing.values() if d.worker_id == worker_id]
            mine = [d.task for d in gone]
            self.seq += bool(gone)
            for doing in gone:
                del self._doing[doing.task.task_id]
                self.epochs[doing.task.epoch].records_trained_twice += doing.progress
                if not self._stopped:
                    doing.task.requeued = True
                    self._todo.appendleft(doing.task)
            if mine:
                logger.info("worker %d is gone; requeued tasks %s", worker_id, [t.task_id for t in mine])
            return mine

    # ------------------------------------------------------------ state

    @property
    def epoch(self) -> int:
        return len(self.epochs) - 1

    @property
    def finished(self) -> bool:
        with self._lock:
            return not self._todo and not self._doing and (self._stopped or self.epoch + 1 >= self._num_epochs)

    @property
    def num_epochs(self) -> int:
        return self._num_epochs

    @property
    def records_per_epoch(self) -> int:
        return sum(s.records for s in self._shards)

    def counts(self) -> tuple[int, int]:
        """(todo, doing) task counts."""
        with self._lock:
            return len(self._todo), len(self._doing)

    def active_workers(self) -> set[int]:
        """Workers holding a task now."""
        with self._lock:
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
        self.epochs.append(EpochStats(epoch, sum(s.records for s in shards)))
        self.seq += 1

    def _advance_epoch(self) -> bool:
        if self._stopped or self.epoch + 1 >= self._num_epochs:
            return False
        self._start_epoch(self.epoch + 1)
        logger.info("epoch %d of %d starts", self.epoch + 1, self._num_epochs)
        return True

    def _requeue_timed_out(self) -> None:
        now = self._clock()
        late = [d for d in self._doing.values() if now - d.started > self._task_timeout]
        for doing in late:
            self.seq += 1
            del self._doing[doing.task.task_id]
            self.epochs[doing.task.epoch].records_trained_twice += doing.progress
            self._retry(
                doing.task,
                f"worker {doing.worker_id} held it longer than --task_timeout={self._task_timeout:g}s",
            )

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


    # ------------------------------------------------------------ the ledger (etcd)

    def snapshot(self, fingerprint: str = "") -> LedgerSnapshot:
        """The whole ledger, for the state store (a restarted master resumes from it)."""
        with self._lock:
            tasks = [_record(d.task, TaskState.DOING, d.worker_id) for d in self._doing.values()]
            tasks += [_record(t, TaskState.TODO) for t in self._todo]
            tasks += [_record(t, TaskState.DROPPED) for e in self.epochs for t in e.dropped]
            return LedgerSnapshot(
                seq=self.seq,
                epoch=self.epoch,
                num_epochs=self._num_epochs,
                next_task_id=self._next_id,
                tasks=tuple(tasks),
                epochs=tuple(
                    EpochRecord(e.epoch, e.records_total, e.records_done, e.records_trained_twice,
                                e.tasks_done, e.tasks_retried)
                    for e in self.epochs
                ),
                task_type=str(self._task_type),
                job_fingerprint=fingerprint,
                saved_at=time.time(),
            )

    def restore(self, snapshot: LedgerSnapshot) -> None:
        """Continue from a saved ledger: done tasks stay done, in-flight tasks go back to todo.

        A dropped task failed the run that dropped it (elasticdl/master/controller.py), so a
        ledger that holds one is resumed by a new run of the job: it is tried again, afresh."""
        resumed = snapshot.requeue_in_flight()
        with self._lock:
            self._todo.clear()
            self._doing.clear()
            self._next_id = resumed.next_task_id
            self.epochs = [
                EpochStats(e.epoch, e.records_total, e.records_done, e.tasks_done, e.tasks_retried, 0,
                           e.records_duplicated)
                for e in resumed.epochs
            ]
            for record in resumed.tasks:
                task = Task(record.task_id, self._task_type, Shard(record.path, record.start, record.end),
                            record.epoch, record.retries)
                if record.state is TaskState.TODO:
                    self._todo.append(task)
                elif record.state is TaskState.DROPPED:
                    task.retries = 0
                    self._todo.append(task)
                    logger.info("task %d (%s records %d-%d) was dropped by the run before: trying it again",
                                task.task_id, record.path, record.start, record.end)
            self.seq = resumed.seq + 1
        logger.info(
            "resumed the task ledger: epoch %d of %d, %d tasks to do (%d were in progress)",
            resumed.epoch + 1, resumed.num_epochs, len(self._todo), len(snapshot.in_state(TaskState.DOING)),
        )


def _record(task: Task, state: TaskState, worker_id: int = -1) -> TaskRecord:
    return TaskRecord(task.task_id, task.shard.path, task.shard.start, task.shard.end, task.epoch,
                      task.retries, state, worker_id)
