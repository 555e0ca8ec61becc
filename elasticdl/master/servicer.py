"""Thin gRPC edge of the master: translate messages, call the task dispatcher, tell the job loop."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import grpc

from elasticdl.data.errors import BadRecord
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.controller import Event, TaskReported, VersionReported
from elasticdl.master.evaluation_service import EVAL_ID_BASE, TaskDispatcher
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.task_manager import NoTask, ReportOutcome, TaskType
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.trust import WORKER_CREDENTIAL_HEADER, TicketFields, credential_problem, mint_ticket

logger = logging.getLogger(__name__)

# A worker's clock counts the batches it pushed: far below this. The master adds an offset to
# it and answers with int64 fields, which a clock near 2**63 would overflow.
MAX_CLOCK = 2**53

_TASK_TYPES = {
    TaskType.TRAINING: elasticdl_pb2.TRAINING,
    TaskType.EVALUATION: elasticdl_pb2.EVALUATION,
    TaskType.PREDICTION: elasticdl_pb2.PREDICTION,
}

# A request for a task waits up to this long for one; at most this many wait at once (the
# server has 16 threads, elasticdl/rpc/channel.py).
TASK_WAIT_SECONDS = 1.0
MAX_WAITING_TASK_REQUESTS = 6


class MasterServicer(elasticdl_pb2_grpc.MasterServicer):
    def __init__(
        self,
        dispatcher: TaskDispatcher,
        progress: TrainingProgress,
        clocks: WorkerClocks,
        scale: Callable[[int], str] | None = None,
        notify: Callable[[Event], None] | None = None,
        job_key: str = "",
    ):
        """``job_key`` (elasticdl/rpc/trust.py; the job always gives it): calls naming a worker id
        must carry that worker's credential, and training tasks go out with a signed ticket."""
        self._job_key = job_key
        self._tasks = dispatcher
        self._scale = scale
        self._notify = notify or (lambda event: None)  # the job loop's event queue
        self._progress = progress
        self._clocks = clocks
        self._waiting = threading.BoundedSemaphore(MAX_WAITING_TASK_REQUESTS)

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

    def _ticket(self, worker_id: int, task) -> bytes:
        if not self._job_key or task.type is not TaskType.TRAINING:
            return b""
        fields = TicketFields(task.task_id, task.handout, worker_id, task.shard.start, task.shard.end)
        return mint_ticket(self._job_key, fields)

    def get_task(self, request, context):
        if request.worker_id < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker_id {request.worker_id} is negative")
        self._check_worker(request.worker_id, context)
        # Held while no task is there (e.g. between two epochs), so the worker gets the next one
        # when it comes; a few requests at a time, so reports always find a server thread.
        if self._waiting.acquire(blocking=False):
            try:
                task = self._tasks.get_task(request.worker_id, wait=TASK_WAIT_SECONDS)
            finally:
                self._waiting.release()
        else:
            task = self._tasks.get_task(request.worker_id)
        if task is NoTask.WAIT:
            return elasticdl_pb2.Task(type=elasticdl_pb2.WAIT)
        if task is NoTask.END:
            return elasticdl_pb2.Task(type=elasticdl_pb2.END)
        ahead = self._tasks.read_ahead(request.worker_id, task)
        footers = self._tasks.footers_for(request.worker_id, [task.shard.path] + ([ahead.path] if ahead else []))
        return elasticdl_pb2.Task(
            task_id=task.task_id,
            type=_TASK_TYPES[task.type],
            path=task.shard.path,
            start=task.shard.start,
            end=task.shard.end,
            epoch=task.epoch,
            snapshot_id=task.snapshot_id,
            model_version=task.model_version,
            handout=task.handout,
            read_ahead=None if ahead is None else elasticdl_pb2.TaskRange(path=ahead.path, start=ahead.start,
                                                                          end=ahead.end),
            footers=[elasticdl_pb2.FileFooter(path=path, size=size, footer=footer) for path, size, footer in footers],
            ticket=self._ticket(request.worker_id, task),
        )

    def report_task_result(self, request, context):
        self._check_worker(request.worker_id, context)
        try:
            states = tensor_codec.decode_list(request.metric_states)
        except tensor_codec.TensorDecodeError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        problem = _report_problem(request)
        if problem:
            logger.warning("ignored report from worker %d: %s", request.worker_id, problem)
            outcome = ReportOutcome(False, problem)
        else:
            outcome = self._tasks.report(
                request.task_id, request.worker_id, request.err_message, request.records, states, request.interrupted,
                bad_records=[BadRecord(r.path, r.index, r.reason) for r in request.bad_records],
                diverged=request.diverged, handout=request.handout,
            )
        if outcome.accepted and not request.err_message and request.task_id < EVAL_ID_BASE:
            self._progress.record(
                request.records, request.loss_sum, request.batches, request.model_version
            )
        self._notify(TaskReported(request.task_id, request.worker_id, outcome.accepted))
        return elasticdl_pb2.ReportTaskResultResponse(
            accepted=outcome.accepted, reason=outcome.reason
        )

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
            request.worker_id, request.clock, self._tasks.active_workers(), request.blocked_seconds
        )
        return elasticdl_pb2.ReportClockResponse(
            clock=view.clock, slowest_clock=view.slowest, fastest_clock=view.fastest
        )

    def report_progress(self, request, context):
        if request.model_version < -1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model_version {request.model_version} is below -1")
        self._check_worker(request.worker_id, context)
        outcome = self._tasks.progress(request.task_id, request.worker_id, request.records_done)
        if not outcome.accepted:  # the worker's reporter logs it; its version is not taken either
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"progress refused: {outcome.reason}")
        if request.model_version > 0:
            self._notify(VersionReported(request.model_version))
        return elasticdl_pb2.Empty()

    def scale(self, request, context):
        if self._scale is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master cannot scale")
        try:
            message = self._scale(request.num_workers)
        except ValueError as err:
            return elasticdl_pb2.ScaleResponse(accepted=False, message=str(err))
        return elasticdl_pb2.ScaleResponse(accepted=True, message=message)


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
