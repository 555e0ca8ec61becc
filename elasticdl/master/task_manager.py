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

    @property
    def records(self) -> int:
        return self.shard.records


@dataclass
class _Doing:
    task: Task
    worker_id: int
    started: float


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
        self._rng = random.Random(seed)
        self._task_type = task_type
        self._shuffle = shuffle
        self._clock = clock
        self._lock = threading.Lock()
        self._next_id = first_task_id
        self._stopped = False
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
            self._doing[task.task_id] = _Doing(task, worker_id, self._clock())
            return task

    def report(
        self, task_id: int, worker_id: int, err_message: str = "", records: int | None = None
    ) -> ReportOutcome:
        """A worker's result for a task; unknown or foreign reports change nothing."""
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
            del self._doing[task_id]
            task = doing.task
            if err_message:
                self._retry(task, f"worker {worker_id} failed it: {err_message}")
                return ReportOutcome(True)
            stats = self.epochs[task.epoch]
            stats.records_done += task.records if records is None else records
            stats.tasks_done += 1
            return ReportOutcome(True)

    def stop(self) -> int:
        """Stop early (EarlyStopping): drop the tasks not started, start no new epoch.

        Tasks in progress still finish. Returns how many tasks were dropped from todo.
        """
        with self._lock:
            dropped = len(self._todo)
            self._todo.clear()
            self._stopped = True
            return dropped

    def recover_worker_tasks(self, worker_id: int) -> list[Task]:
        """Put a dead worker's in-progress tasks back at the front of todo."""
        with self._lock:
            mine = [d.task for d in self._doing.values() if d.worker_id == worker_id]
            for task in mine:
                del self._doing[task.task_id]
                if not self._stopped:
                    self._todo.appendleft(task)
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
            self._rng.shuffle(shards)
        for shard in shards:
            self._todo.append(Task(self._next_id, self._task_type, shard, epoch))
            self._next_id += 1
        self.epochs.append(EpochStats(epoch, sum(s.records for s in shards)))

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
            del self._doing[doing.task.task_id]
            self._retry(
                doing.task,
                f"worker {doing.worker_id} held it longer than --task_timeout={self._task_timeout:g}s",
            )

    def _retry(self, task: Task, why: str) -> None:
        task.retries += 1
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
