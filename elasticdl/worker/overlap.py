"""Exchange: a batch's push (and the pull after it) on a background thread.

With ``--use_async --overlap_communication`` the worker starts batch k's exchange with the
parameter servers and computes batch k+1 meanwhile; before it starts the next exchange it
settles this one (``result``), so at most one is in flight. The exchange only talks to the
PS: what its answers mean (versions, the SSP clock, loading parameters) is done on the
worker's own thread, by the same code as a synchronous push, so an error raised in the
background surfaces there and is handled as a synchronous push's error would be.

A retry (a PS restarted during the exchange) runs the exchange again on the worker's thread,
freshly prepared: a pull prepared after a reconnect asks for everything. The push is the
same, named by the same batch position, so the PS takes it once (ps/data_position.py).

>>> from concurrent.futures import ThreadPoolExecutor
>>> with ThreadPoolExecutor(1) as pool:
...     exchange = Exchange(pool, lambda: (lambda: 41 + 1))
...     exchange.result()
42
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from typing import Generic, TypeVar

T = TypeVar("T")


class Exchange(Generic[T]):
    """One call run in the background; its answer (or error) is taken on the caller's thread.

    ``prepare`` runs on the caller's thread and returns the call to run: on ``executor`` at
    once, and again, inline, for each ``result`` after one that raised (the retry).
    """

    def __init__(self, executor: Executor, prepare: Callable[[], Callable[[], T]]):
        self._prepare = prepare
        self._future: Future | None = executor.submit(prepare())

    def result(self) -> T:
        """Wait for the call and return its answer; its error is raised here. After an error,
        the next ``result`` prepares and runs the call again on this thread."""
        if self._future is None:
            return self._prepare()()
        future, self._future = self._future, None
        return future.result()

    def wait(self) -> None:
        """Wait until the background call ended, whatever its outcome (nothing is raised): a
        task left early must not have a push land after it was reported."""
        if self._future is not None:
            wait([self._future])
