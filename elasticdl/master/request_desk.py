"""The job loop's side of the workers' requests: serve each on the loop's thread, in arrival order.

The loop (``Job._loop``) is the only thread that touches the task ledgers (main and evaluation)
and the controller. The gRPC threads only enqueue requests (``elasticdl.master.requests``); the
desk serves them against the ``TaskDispatcher``, resolves their futures, and returns the events
an answer implies for the controller (``TaskReported``, ``VersionReported``). A request for a
task that finds none and may wait is parked: tried again after each change of a ledger,
answered WAIT at its deadline, and at once (END or WAIT) when the job finishes or halts.
Other threads read what they need of the ledgers from what the desk publishes
(``active_workers``), never the ledgers themselves.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticdl.master.controller import Event, TaskReported, VersionReported
from elasticdl.master.dispatcher import TaskDispatcher
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.progressive import ProgressiveWindows
from elasticdl.master.requests import (
    END,
    WAIT,
    GetTask,
    ReportProgress,
    ReportTask,
    Request,
    RequestLine,
    TaskOrder,
    Verdict,
)
from elasticdl.master.tasks import EVAL_ID_BASE, NoTask, Task

logger = logging.getLogger(__name__)


@dataclass
class _Parked:
    request: GetTask
    deadline: float


class RequestDesk:
    """Serves the workers' requests on the job loop's thread (see the module's docstring).

    >>> desk = RequestDesk(dispatcher, progress, clock=time.monotonic)  # doctest: +SKIP
    >>> for event in desk.serve(request): controller_feed(event)       # the loop, per request
    >>> desk.settle()                                                   # after each change
    """

    def __init__(
        self,
        dispatcher: TaskDispatcher,
        progress: TrainingProgress | None = None,
        clock: Callable[[], float] = time.monotonic,
        progressive: ProgressiveWindows | None = None,
    ):
        self._dispatcher = dispatcher
        self._progress = progress
        self._progressive = progressive  # --window_records: training reports' scores, per window
        self._clock = clock
        self._parked: list[_Parked] = []
        self._mark: tuple = ()
        # Published for other threads (report_clock): replaced whole, never mutated.
        self.active_workers: frozenset[int] = frozenset()

    @property
    def parked(self) -> int:
        return len(self._parked)

    def next_deadline(self) -> float | None:
        """When the first parked request is due for its WAIT (None: none is parked)."""
        return min((p.deadline for p in self._parked), default=None)

    def serve(self, request: Request) -> list[Event]:
        """Answer ``request`` (or park it); the events its answer implies, for the controller."""
        if not request.future.set_running_or_notify_cancel():
            return []  # withdrawn by its gRPC thread (deadline): it never happened
        self._dispatcher.heard(request.worker_id, self._clock())
        try:
            match request:
                case GetTask():
                    self._get_task(request)
                    return []
                case ReportTask():
                    return self._report(request)
                case ReportProgress():
                    return self._report_progress(request)
            raise TypeError(f"not a request of the job loop: {request!r}")
        except Exception as err:
            # The handler's thread raises it (the call fails, as a handler's own error would).
            logger.exception("serving %s failed", type(request).__name__)
            if not request.future.done():
                request.future.set_exception(err)
            return []
        finally:
            self._publish()

    def settle(self) -> None:
        """After a change (a request served, an event fed, a tick): parked requests try again if a
        ledger moved, get WAIT past their deadline, and END or WAIT once the job finished or halted."""
        self._publish()
        if not self._parked:
            return
        now = self._clock()
        mark = self._ledger_mark()
        moved, self._mark = mark != self._mark, mark
        still = []
        for parked in self._parked:
            if self._dispatcher.finished or self._dispatcher.halted:
                parked.request.future.set_result(self._no_task())
            elif self._dispatcher.gone(parked.request.worker_id):  # parked before its exit was handled
                parked.request.future.set_result(END)
            elif moved and isinstance(task := self._dispatcher.get_task(parked.request.worker_id), Task):
                parked.request.future.set_result(self._answer(parked.request.worker_id, task))
                self._mark = self._ledger_mark()  # a hand-out moved the ledger: the others see it
            elif now >= parked.deadline:
                parked.request.future.set_result(WAIT)
            else:
                still.append(parked)
        self._parked = still

    def wait_seconds(self, poll_seconds: float) -> float:
        """How long the loop may wait for the next arrival: its poll interval, or less if a parked
        request is due for its WAIT sooner."""
        due = self.next_deadline()
        return poll_seconds if due is None else max(0.0, min(poll_seconds, due - self._clock()))

    def take(self, arrived: list) -> list:
        """Serve the requests among ``arrived``, in order; the other items and the events the
        answers imply, in the same order."""
        events: list = []
        for item in arrived:
            if isinstance(item, Request):
                events += self.serve(item)
                self.settle()
            else:
                events.append(item)
        return events

    def close(self, line: RequestLine, pending: queue.SimpleQueue) -> None:
        """The loop stops: requests still in ``pending``, parked ones and every later one
        (``line``) get their answer now, from no ledger (``closing_answer``)."""
        line.close(self.closing_answer)  # no request enters ``pending`` after this
        for parked in self._parked:
            parked.request.future.set_result(self._no_task())
        self._parked = []
        while True:
            try:
                item = pending.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Request) and item.future.set_running_or_notify_cancel():
                item.future.set_result(self.closing_answer(item))

    def closing_answer(self, request: Request):
        """The answer to a request the loop never serves (it stopped): no ledger is touched."""
        if isinstance(request, GetTask):
            return self._no_task()
        return Verdict(False, "the master's job loop has stopped")

    # ------------------------------------------------------------ serving

    def _get_task(self, request: GetTask) -> None:
        task = self._dispatcher.get_task(request.worker_id)
        if isinstance(task, Task):
            request.future.set_result(self._answer(request.worker_id, task))
        elif task is NoTask.WAIT and request.wait > 0 and not self._dispatcher.halted:
            if not self._parked:
                self._mark = self._ledger_mark()
            self._parked.append(_Parked(request, self._clock() + request.wait))
        else:
            request.future.set_result(END if task is NoTask.END else WAIT)

    def _answer(self, worker_id: int, task: Task) -> TaskOrder:
        ahead = self._dispatcher.read_ahead(worker_id, task)
        paths = [task.shard.path] + ([ahead.path] if ahead else [])
        return TaskOrder(
            str(task.type), task.task_id, task.shard.path, task.shard.start, task.shard.end, task.epoch,
            task.snapshot_id, task.model_version, task.handout,
            None if ahead is None else (ahead.path, ahead.start, ahead.end),
            tuple(self._dispatcher.footers_for(worker_id, paths)),
        )

    def _report(self, request: ReportTask) -> list[Event]:
        if request.problem:
            logger.warning("ignored report from worker %d: %s", request.worker_id, request.problem)
            outcome = Verdict(False, request.problem)
        else:
            found = self._dispatcher.report(
                request.task_id, request.worker_id, request.err_message, request.records, request.states,
                request.interrupted, bad_records=request.bad_records, diverged=request.diverged,
                handout=request.handout,
            )
            outcome = Verdict(found.accepted, found.reason)
        if (outcome.accepted and not request.err_message and request.task_id < EVAL_ID_BASE
                and self._progress is not None):
            self._progress.record(request.records, request.loss_sum, request.batches, request.model_version)
            if self._progressive is not None:
                self._progressive.add(request.records, request.states, request.model_version)
        request.future.set_result(outcome)
        return [TaskReported(request.task_id, request.worker_id, outcome.accepted)]

    def _report_progress(self, request: ReportProgress) -> list[Event]:
        found = self._dispatcher.progress(request.task_id, request.worker_id, request.records_done)
        request.future.set_result(Verdict(found.accepted, found.reason))
        # A refused progress report's version is not taken either (the worker may be a stale one).
        return [VersionReported(request.model_version)] if found.accepted and request.model_version > 0 else []

    # ------------------------------------------------------------ state

    def _no_task(self) -> TaskOrder:
        return END if self._dispatcher.finished and not self._dispatcher.halted else WAIT

    def _ledger_mark(self) -> tuple:
        """Moves whenever a ledger a task could come from changes (cheap: counters and ids)."""
        main, evaluation = self._dispatcher.main, self._dispatcher.evaluation
        current = evaluation.current if evaluation is not None else None
        return (
            main.seq if main is not None else 0,
            None if current is None else (current.round_id, current.suspended, current.tasks.seq),
        )

    def _publish(self) -> None:
        self.active_workers = frozenset(self._dispatcher.active_workers())
