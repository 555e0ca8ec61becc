"""What the master's gRPC threads ask its job loop: the requests, their answers, and the line in.

The job loop's thread is the only one that touches the task ledgers and the controller
(docs/architecture.md, "The master's threads"). A gRPC handler checks its request (credentials,
ranges), puts it on the loop's event queue through a ``RequestLine`` and waits on the request's
future; the loop serves requests in arrival order (``elasticdl.master.request_desk``). This module
is the whole vocabulary the servicer shares with the loop: it imports no ledger.

>>> line = RequestLine(events.put)                          # doctest: +SKIP
>>> line.ask(GetTask(worker_id=0, wait=1.0), timeout=11.0)  # a gRPC thread
TaskOrder(kind='training', task_id=3, ...)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from elasticdl.data.errors import BadRecord
from elasticdl.rpc.master_client import TaskOrder

__all__ = ["END", "WAIT", "GetTask", "LoopBusy", "ReportProgress", "ReportTask", "Request", "RequestLine",
           "TaskOrder", "Verdict"]


# What ``get_task`` answers is what the worker reads (``TaskOrder``): a task, ``wait`` or ``end``.
# The loop leaves ``ticket`` empty; the servicer signs the hand-out (elasticdl/rpc/trust.py).
WAIT = TaskOrder("wait")
END = TaskOrder("end")


@dataclass(frozen=True)
class Verdict:
    """What a report or a progress report answers: taken, or refused and why."""

    accepted: bool
    reason: str = ""


@dataclass(eq=False)
class Request:
    """A question for the job loop; the loop sets its answer on ``future``."""

    future: Future = field(default_factory=Future, init=False, repr=False)


@dataclass(eq=False)
class GetTask(Request):
    worker_id: int
    wait: float = 0.0  # with no task now, hold the request up to this long for one


@dataclass(eq=False)
class ReportTask(Request):
    task_id: int
    worker_id: int
    err_message: str = ""
    records: int = 0
    states: dict = field(default_factory=dict)  # evaluation: the metric states, decoded
    interrupted: bool = False
    bad_records: tuple[BadRecord, ...] = ()
    diverged: bool = False
    handout: int = 0
    # For the progress line: an accepted training report's loss, batches and version.
    loss_sum: float = 0.0
    batches: int = 0
    model_version: int = 0
    problem: str = ""  # what the servicer found wrong with it: refused, with this reason


@dataclass(eq=False)
class ReportProgress(Request):
    task_id: int
    worker_id: int
    records_done: int
    model_version: int = 0


class LoopBusy(RuntimeError):
    """The job loop did not take the request within its deadline (a long decision, e.g. a PS
    relaunch): the request was withdrawn, nothing of it was recorded, the caller may retry."""


class RequestLine:
    """The way into the job loop from any thread: ``ask`` puts a request and waits for its answer.

    Once the loop stops (``close``), requests are answered at once by ``closing_answer``, and
    so are those still queued (the loop drains them, ``Job._loop``).
    """

    def __init__(self, put: Callable[[object], None]):
        self._put = put
        self._lock = threading.Lock()
        self._closing: Callable[[Request], object] | None = None

    def ask(self, request: Request, timeout: float):
        """The loop's answer to ``request``; ``LoopBusy`` when it did not take it within ``timeout`` s."""
        with self._lock:  # a request put before close() is drained by the loop; none after it
            closing = self._closing
            if closing is None:
                self._put(request)
        if closing is not None:
            return closing(request)
        try:
            return request.future.result(timeout)
        except FutureTimeout:
            # Withdrawn before the loop took it: nothing of it happened, so a retry is safe. If the
            # loop took it meanwhile, its answer comes at once (the loop serves without waiting).
            if request.future.cancel():
                raise LoopBusy(f"the master's job loop did not take the request within {timeout:.0f}s") from None
            return request.future.result()

    def close(self, closing_answer: Callable[[Request], object]) -> None:
        """The loop stopped: answer every later request with ``closing_answer(request)``."""
        with self._lock:
            self._closing = closing_answer

    def reopen(self) -> None:
        """The loop runs again (the job reopened after its end): requests go to it again."""
        with self._lock:
            self._closing = None
