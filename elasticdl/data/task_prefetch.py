"""Task read-ahead: the records of a worker's next task read while it trains this one.

With each task the master promises a worker the task it gets next (the ``read_ahead`` of
elasticdl/master/task_manager.py). The worker ``start``s reading that range here at once
and ``take``s it when the task comes: a task's data then arrives while the one before it
trains, and the worker does not wait on the network between tasks. A read that was not
started (the first task, a promise that did not hold) or that failed is done when taken,
so a task's records and errors are the same with or without read-ahead.

At most ``depth`` reads are held: one for the next task, and one for the task taken now
while it is still arriving. A read no longer wanted is dropped when it is done (its
``dispose``: a stream's reader thread stops).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TaskPrefetch(Generic[T]):
    """``load(key)`` of the keys started, in background threads; taken once each."""

    def __init__(self, load: Callable[[Hashable], T], dispose: Callable[[T], None] = lambda value: None,
                 depth: int = 2):
        self._load = load
        self._dispose = dispose
        self._depth = depth
        self._pending: OrderedDict[Hashable, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.taken = 0  # keys taken
        self.taken_ahead = 0  # of them, read ahead

    def start(self, key: Hashable) -> None:
        """Read ``key`` in the background (nothing if it is being read)."""
        if key in self._pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._depth, thread_name_prefix="task-read-ahead")
        self._pending[key] = self._pool.submit(self._load, key)
        while len(self._pending) > self._depth:
            _, oldest = self._pending.popitem(last=False)
            self._drop(oldest)

    def take(self, key: Hashable) -> T:
        """``load(key)``: the read started for it (waited for), or one done now."""
        self.taken += 1
        future = self._pending.pop(key, None)
        if future is not None:
            try:
                value = future.result()
                self.taken_ahead += 1
                return value
            except Exception as err:  # read again here, where its error is the task's
                logger.info("reading %s ahead failed (%s: %s); reading it again", key, type(err).__name__, err)
        return self._load(key)

    def close(self) -> None:
        """Drop every read; the threads end after the reads under way."""
        while self._pending:
            self._drop(self._pending.popitem()[1])
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _drop(self, future: Future) -> None:
        def dispose(done: Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self._dispose(done.result())

        future.add_done_callback(dispose)
