"""Read-ahead promises: which task each worker gets next, so it reads it while training this one.

A promised task stays in todo (the ledger does not change): it goes to the worker it was
promised to, and to another only when every task left is promised to someone. It leaves todo
only through ``take_for``, which ends its promise, or with a reset of todo (``end()``).
"""

from __future__ import annotations

from collections import deque

from elasticdl.master.tasks import Task


class ReadAheadPromises:
    def __init__(self):
        self._promised: dict[int, Task] = {}  # worker id -> its next task
        self._promised_to: dict[int, int] = {}  # task id -> its worker

    def of(self, worker_id: int) -> Task | None:
        return self._promised.get(worker_id)

    def take_for(self, todo: deque[Task], worker_id: int) -> Task:
        """Out of ``todo`` (not empty): the first task promised to ``worker_id`` or to nobody,
        else the first (whose worker's promise is broken).

        A task promised to nobody ahead of this worker's promised one came back to the front
        (a retry, a dead worker's) after the promise: it goes first, and the promise stands.
        """
        for i, task in enumerate(todo):  # past at most one promised task per worker
            holder = self._promised_to.get(task.task_id)
            if holder is None or holder == worker_id:
                del todo[i]
                if holder is not None:
                    self.end(worker_id)
                return task
        task = todo.popleft()
        self.end(self._promised_to[task.task_id])
        return task

    def promise_next(self, todo: deque[Task], worker_id: int) -> None:
        if worker_id in self._promised:
            return
        for task in todo:
            if task.task_id not in self._promised_to:
                self._promised[worker_id] = task
                self._promised_to[task.task_id] = worker_id
                return

    def end(self, worker_id: int | None = None) -> None:
        """Forget the promise to ``worker_id`` (None: every one: todo was reset)."""
        if worker_id is None:
            self._promised.clear()
            self._promised_to.clear()
            return
        task = self._promised.pop(worker_id, None)
        if task is not None:
            del self._promised_to[task.task_id]
