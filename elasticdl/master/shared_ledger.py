"""The task ledger as the master's threads share it: every call under one lock.

The ledger (``TaskManager``) is pure and single-threaded. In a job, the master's gRPC threads
hand out tasks and take reports while the job's loop steps the controller, so each call goes
through this wrapper, under one lock; a worker's request for a task may wait for the ledger to
change (``wait_for_change``) rather than sleep and ask again.
"""

from __future__ import annotations

import threading

from elasticdl.master.task_manager import TaskManager


class SharedLedger:
    """``ledger``'s methods and attributes, each call under one lock.

    >>> shared = SharedLedger(TaskManager(shards))     # doctest: +SKIP
    >>> shared.get_task(0)                             # any thread
    """

    def __init__(self, ledger: TaskManager):
        self._ledger = ledger
        self._changes = threading.Condition()
        self._wakes = 0

    @property
    def ledger(self) -> TaskManager:
        return self._ledger

    def __getattr__(self, name: str):
        with self._changes:
            value = getattr(self._ledger, name)
        if not callable(value):
            return value

        def locked(*args, **kwargs):
            with self._changes:
                seq = self._ledger.seq
                try:
                    return value(*args, **kwargs)
                finally:
                    if self._ledger.seq != seq:
                        self._changes.notify_all()

        return locked

    def wake(self) -> None:
        """Wake the requests waiting for a change (the job ends, or its master stops acting)."""
        with self._changes:
            self._wakes += 1  # not a change of the ledger: no save
            self._changes.notify_all()

    def wait_for_change(self, seq: int, timeout: float) -> None:
        """Return once ``seq`` moved on (a task reported, an epoch opened, ...) or after ``timeout`` s."""
        with self._changes:
            wakes = self._wakes
            self._changes.wait_for(lambda: self._ledger.seq != seq or self._wakes != wakes, timeout)
