"""Thin gRPC edge of the master: check a request, hand it to the job loop, answer what it says.

The handlers never touch a task ledger or the controller: each one checks its request
(credentials, ranges), asks the job loop through a ``RequestLine`` (elasticdl/master/requests.py)
and waits for the answer. The loop serves requests one at a time, in arrival order
(elasticdl/master/request_desk.py). A loop that does not take a request in time (a long
decision, such as a PS relaunch) withdraws it and the call fails UNAVAILABLE: the worker tries
again (elasticdl/rpc/master_client.py).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import grpc

from elasticdl.data.errors import BadRecord
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.requests import GetTask, LoopBusy, ReportProgress, ReportTask, RequestLine, TaskOrder
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.trust import WORKER_CREDENTIAL_HEADER, TicketFields, credential_problem, mint_ticket

logger = logging.getLogger(__name__)

# A worker's clock counts the batches it pushed: far below this. The master adds an offset to
# it and answers with int64 fields, which a clock near 2**63 would overflow.
MAX_CLOCK = 2**53

_TASK_TYPES = {
    "training": elasticdl_pb2.TRAINING,
    "evaluation": elasticdl_pb2.EVALUATION,
    "prediction": elasticdl_pb2.PREDICTION,
    "wait": elasticdl_pb2.WAIT,
    "end": elasticdl_pb2.END,
}

# A request for a task waits up to this long for one; at most this many wait at once (the
# server has 16 threads, elasticdl/rpc/channel.py).
TASK_WAIT_SECONDS = 1.0
MAX_WAITING_TASK_REQUESTS = 6
# The job loop takes a request within this long, or the call fails UNAVAILABLE and the worker
# tries again. Well under the worker's own deadline (MASTER_CALL_SECONDS in
# elasticdl/rpc/master_client.py), so the worker hears UNAVAILABLE rather than timing out.
LOOP_ANSWER_SECONDS = 10.0
# A large vocabulary travels in pieces well under any message limit.
STATE_CHUNK_BYTES = 1 << 20


class MasterServicer(elasticdl_pb2_grpc.MasterServicer):
    def __init__(
        self,
        line: RequestLine,
        clocks: WorkerClocks,
        active_workers: Callable[[], frozenset[int]],
        scale: Callable[[int], str] | None = None,
        job_key: str = "",
        stop: Callable[[str], str] | None = None,
        preprocessing_state: Callable[[], bytes | None] | None = None,
    ):
        """``line`` leads to the job loop; ``active_workers`` reads the workers holding a task as
        the loop last published them (report_clock never waits for the loop). ``job_key``
        (elasticdl/rpc/trust.py; the job always gives it): calls naming a worker id must carry
        that worker's credential, and training tasks go out with a signed ticket.
        ``preprocessing_state``: the master's adapted preprocessing state as .npz bytes (``b""``:
        none), or None until the master has built its model."""
        self._job_key = job_key
        self._line = line
        self._scale = scale
        self._stop = stop
        self._preprocessing_state = preprocessing_state
        self._clocks = clocks
        self._active_workers = active_workers
        self._waiting = threading.BoundedSemaphore(MAX_WAITING_TASK_REQUESTS)

    def _ask(self, request, context, wait: float = 0.0):
        """The job loop's answer to ``request``; UNAVAILABLE (the worker retries) if it is too busy."""
        try:
            return self._line.ask(request, timeout=wait + LOOP_ANSWER_SECONDS)
        except LoopBusy as err:
            logger.warning("%s of worker %d: %s", type(request).__name__, request.worker_id, err)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))

    def _check_worker(self, worker_id: int, context) -> None:
        """PERMISSION_DENIED unless the call carries worker ``worker_id``'s credential: only the
        workers this master launched get tasks and report, each as itself."""
        if not self._job_key:
            return
        sent = dict(context.invocation_metadata() or ()).get(WORKER_CREDENTIAL_HEADER, "")
        problem = credential_problem(self._job_key, worker_id, str(sent))
        if problem:
            logger.warning("refused a call naming worker %d: %s", worker_id, problem)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)

    def _ticket(self, worker_id: int, task: TaskOrder) -> bytes:
        if not self._job_key or task.kind != "training":
            return b""
        fields = TicketFields(task.task_id, task.handout, worker_id, task.start, task.end)
        return mint_ticket(self._job_key, fields)

    def get_task(self, request, context):
        if request.worker_id < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker_id {request.worker_id} is negative")
        self._check_worker(request.worker_id, context)
        # Held while no task is there (e.g. between two epochs), so the worker gets the next one
        # when it comes; a few requests at a time, so reports always find a server thread.
        if self._waiting.acquire(blocking=False):
            try:
                answer = self._ask(GetTask(request.worker_id, TASK_WAIT_SECONDS), context, TASK_WAIT_SECONDS)
            finally:
                self._waiting.release()
        else:
            answer = self._ask(GetTask(request.worker_id), context)
        if answer.kind in ("wait", "end"):
            return elasticdl_pb2.Task(type=_TASK_TYPES[answer.kind])
        return elasticdl_pb2.Task(
            task_id=answer.task_id,
            type=_TASK_TYPES[answer.kind],
            path=answer.path,
            start=answer.start,
            end=answer.end,
            epoch=answer.epoch,
            snapshot_id=answer.snapshot_id,
            model_version=answer.model_version,
            handout=answer.handout,
            read_ahead=None if answer.read_ahead is None else elasticdl_pb2.TaskRange(
                path=answer.read_ahead[0], start=answer.read_ahead[1], end=answer.read_ahead[2]),
            footers=[elasticdl_pb2.FileFooter(path=path, size=size, footer=footer)
                     for path, size, footer in answer.footers],
            ticket=self._ticket(request.worker_id, answer),
        )

    def report_task_result(self, request, context):
        self._check_worker(request.worker_id, context)
        try:
            states = tensor_codec.decode_list(request.metric_states)
        except tensor_codec.TensorDecodeError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        # A report with a problem still goes to the loop: the controller hears of every report.
        outcome = self._ask(ReportTask(
            request.task_id, request.worker_id, request.err_message, request.records, states,
            request.interrupted, tuple(BadRecord(r.path, r.index, r.reason) for r in request.bad_records),
            request.diverged, request.handout, request.loss_sum, request.batches, request.model_version,
            problem=_report_problem(request),
        ), context)
        return elasticdl_pb2.ReportTaskResultResponse(accepted=outcome.accepted, reason=outcome.reason)

    def report_clock(self, request, context):
        if not 0 <= request.clock <= MAX_CLOCK or not math.isfinite(request.blocked_seconds) \
                or request.blocked_seconds < 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"clock {request.clock} must be in [0, {MAX_CLOCK}] and blocked_seconds "
                f"{request.blocked_seconds} >= 0 and finite",
            )
        self._check_worker(request.worker_id, context)
        view = self._clocks.report(
            request.worker_id, request.clock, set(self._active_workers()), request.blocked_seconds
        )
        return elasticdl_pb2.ReportClockResponse(
            clock=view.clock, slowest_clock=view.slowest, fastest_clock=view.fastest
        )

    def report_progress(self, request, context):
        if request.model_version < -1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model_version {request.model_version} is below -1")
        self._check_worker(request.worker_id, context)
        outcome = self._ask(ReportProgress(request.task_id, request.worker_id, request.records_done,
                                           request.model_version), context)
        if not outcome.accepted:  # the worker's reporter logs it; its version is not taken either
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"progress refused: {outcome.reason}")
        return elasticdl_pb2.Empty()

    def scale(self, request, context):
        if self._scale is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master cannot scale")
        try:
            message = self._scale(request.num_workers)
        except ValueError as err:
            return elasticdl_pb2.ScaleResponse(accepted=False, message=str(err))
        return elasticdl_pb2.ScaleResponse(accepted=True, message=message)

    def stop(self, request, context):
        if self._stop is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master cannot stop early")
        try:
            message = self._stop(request.reason[:200] or "elasticdl stop")
        except ValueError as err:
            return elasticdl_pb2.ScaleResponse(accepted=False, message=str(err))
        return elasticdl_pb2.ScaleResponse(accepted=True, message=message)

    def get_preprocessing_state(self, request, context):
        self._check_worker(request.worker_id, context)
        if self._preprocessing_state is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master hands out no preprocessing state")
        state = self._preprocessing_state()
        if state is None:  # the worker asks again (MasterClient retries UNAVAILABLE)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the master is still building its model")
        for start in range(0, len(state), STATE_CHUNK_BYTES):
            yield elasticdl_pb2.StateChunk(data=state[start:start + STATE_CHUNK_BYTES])


def _report_problem(request) -> str:
    """What no worker puts in a task report ('' when nothing): the ledger checks the rest
    (who holds the task, records within its size, metric states)."""
    if request.records < 0:
        return f"report for task {request.task_id} with {request.records} records (never negative)"
    if request.batches < 0:
        return f"report for task {request.task_id} with {request.batches} batches (never negative)"
    if not math.isfinite(request.loss_sum):
        return f"report for task {request.task_id} with a loss sum of {request.loss_sum} (must be finite)"
    if request.model_version < -1:
        return f"report for task {request.task_id} at model version {request.model_version} (below -1)"
    return ""
