"""The task ledger to and from the state store: a snapshot a restarted master resumes from.

A part of ``TaskManager`` (elasticdl/master/task_manager.py) kept in its own module: what the
ledger holds is written out as a ``LedgerSnapshot`` (elasticdl/store/ledger.py) and read back.
"""

from __future__ import annotations

import logging
from collections import deque

from elasticdl.data.sources import Shard
from elasticdl.master.promises import ReadAheadPromises
from elasticdl.master.tasks import Doing, EpochStats, Fencing, Task, TaskType
from elasticdl.store.ledger import EpochRecord, LedgerSnapshot, TaskRecord, TaskState

logger = logging.getLogger(__name__)


class LedgerPersistence:
    """``snapshot`` and ``restore`` of the ledger's state (the attributes ``TaskManager`` sets)."""

    seq: int
    epochs: list[EpochStats]
    _todo: deque[Task]
    _doing: dict[int, Doing]
    _fencing: dict[int, Fencing]
    _done: dict[int, Task]
    _next_id: int
    _num_epochs: int
    _task_type: TaskType
    _opened: int | None
    _promises: ReadAheadPromises
    epoch: int  # a property of the ledger
    _in_flight: list[Doing]  # a property of the ledger

    def snapshot(self, fingerprint: str = "", saved_at: float = 0.0) -> LedgerSnapshot:
        """The whole ledger, for the state store (a restarted master resumes from it)."""
        tasks = [_record(d.task, TaskState.DOING, d.worker_id) for d in self._in_flight]
        tasks += [_record(t, TaskState.TODO) for t in self._todo]
        tasks += [_record(t, TaskState.DROPPED) for e in self.epochs for t in e.dropped]
        tasks += [_record(t, TaskState.DONE) for t in self._done.values()]
        return LedgerSnapshot(
            seq=self.seq,
            epoch=self.epoch,
            num_epochs=self._num_epochs,
            next_task_id=self._next_id,
            tasks=tuple(tasks),
            epochs=tuple(
                EpochRecord(e.epoch, e.records_total, e.records_done, e.records_trained_twice,
                            e.tasks_done, e.tasks_retried, dict(e.retrained))
                for e in self.epochs
            ),
            task_type=str(self._task_type),
            job_fingerprint=fingerprint,
            saved_at=saved_at,
        )

    def restore(self, snapshot: LedgerSnapshot) -> None:
        """Continue from a saved ledger: done tasks stay done, in-flight tasks go back to todo.

        A dropped task failed the run that dropped it (elasticdl/master/controller.py), so a
        ledger that holds one is resumed by a new run of the job: it is tried again, afresh."""
        resumed = snapshot.requeue_in_flight()
        self._todo.clear()
        self._promises.end()
        self._doing.clear()
        self._fencing.clear()
        self._next_id = resumed.next_task_id
        self.epochs = [
            EpochStats(e.epoch, e.records_total, e.records_done, e.tasks_done, e.tasks_retried, 0,
                       e.records_duplicated, retrained=dict(e.retrained))
            for e in resumed.epochs
        ]
        self._done = {}
        for record in resumed.tasks:
            task = Task(record.task_id, self._task_type, Shard(record.path, record.start, record.end),
                        record.epoch, record.retries, origin=record.origin)
            if record.state is TaskState.DONE:
                self._done[task.task_id] = task
            elif record.state is TaskState.TODO:
                self._todo.append(task)
            elif record.state is TaskState.DROPPED:
                task.retries = 0
                self._todo.append(task)
                logger.info("task %d (%s records %d-%d) was dropped by the run before: trying it again",
                            task.task_id, record.path, record.start, record.end)
        self.seq = resumed.seq + 1
        if self._opened is not None:
            self._opened = resumed.epoch  # the epoch it was in is open: its tasks go on
        logger.info(
            "resumed the task ledger: epoch %d of %d, %d tasks to do (%d were in progress)",
            resumed.epoch + 1, resumed.num_epochs, len(self._todo), len(snapshot.in_state(TaskState.DOING)),
        )


def _record(task: Task, state: TaskState, worker_id: int = -1) -> TaskRecord:
    return TaskRecord(task.task_id, task.shard.path, task.shard.start, task.shard.end, task.epoch,
                      task.retries, state, worker_id, task.origin)
