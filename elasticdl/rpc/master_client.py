"""A worker's connection to the master."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.auth import HeaderCallInterceptor
from elasticdl.rpc.channel import make_channel, wait_for_channel
from elasticdl.rpc.trust import WORKER_CREDENTIAL_ENV, WORKER_CREDENTIAL_HEADER

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskOrder:
    """What the master told the worker to do next."""

    kind: str  # "training", "evaluation", "prediction", "wait" or "end"
    task_id: int = 0
    path: str = ""
    start: int = 0
    end: int = 0
    epoch: int = 0
    snapshot_id: int = 0  # evaluation: the PS snapshot to evaluate
    model_version: int = -1
    handout: int = 0  # training: this hand-out of the task (pushes and the report name it)
    read_ahead: tuple[str, int, int] | None = None  # (path, start, end) of the task promised next
    footers: tuple[tuple[str, int, bytes], ...] = ()  # (path, size, footer) of Parquet files the master read
    ticket: bytes = b""  # training: the master's signature of this hand-out; every push of it carries it


# The master's job loop answers within its own deadline (LOOP_ANSWER_SECONDS, 10 s, in
# elasticdl/master/servicer.py) or says UNAVAILABLE; this one is for a master that hangs.
MASTER_CALL_SECONDS = 30.0
# A call that finds the master away (UNAVAILABLE: busy with a long decision such as a PS
# relaunch, or restarting; DEADLINE_EXCEEDED: frozen) is tried again for this long, pausing
# 0.1 s, doubling up to 2 s. A request the master did not take changed nothing, so a retry is safe.
MASTER_RETRY_SECONDS = 120.0
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

_KINDS = {
    elasticdl_pb2.TRAINING: "training",
    elasticdl_pb2.EVALUATION: "evaluation",
    elasticdl_pb2.PREDICTION: "prediction",
    elasticdl_pb2.WAIT: "wait",
    elasticdl_pb2.END: "end",
}


class MasterClient:
    def __init__(self, address: str, worker_id: int, connect_timeout: float = 60.0, credential: str | None = None):
        """``credential``: this worker's, which the master minted at launch (default:
        ``$ELASTICDL_WORKER_CREDENTIAL``); every call carries it, and the master refuses calls
        naming this worker id without it (elasticdl/rpc/trust.py)."""
        self.worker_id = worker_id
        credential = os.environ.get(WORKER_CREDENTIAL_ENV, "") if credential is None else credential
        self._channel = make_channel(address)
        if credential:
            self._channel = grpc.intercept_channel(
                self._channel, HeaderCallInterceptor(WORKER_CREDENTIAL_HEADER, credential))
        wait_for_channel(self._channel, address, connect_timeout)
        self._stub = elasticdl_pb2_grpc.MasterStub(self._channel)
        self._progress = _ProgressReporter(self._stub, worker_id)
        self.retry_seconds = MASTER_RETRY_SECONDS
        self._sleep = time.sleep  # tests pass time by

    def _call(self, method, request):
        """``method(request)`` with a deadline, tried again while the master is away (RETRIED_CODES)."""
        give_up, pause = time.monotonic() + self.retry_seconds, 0.1
        while True:
            try:
                return method(request, timeout=MASTER_CALL_SECONDS)
            except grpc.RpcError as err:
                if err.code() not in RETRIED_CODES or time.monotonic() + pause > give_up:
                    raise
                logger.warning("the master is away (%s: %s); asking again in %.1fs", err.code().name,
                               err.details(), pause)
            self._sleep(pause)
            pause = min(pause * 2, 2.0)

    def preprocessing_state(self) -> bytes:
        """The master's adapted preprocessing state, as .npz bytes (``b""``: the model has none)."""
        request = elasticdl_pb2.PreprocessingStateRequest(worker_id=self.worker_id)
        return self._call(lambda r, timeout: b"".join(
            chunk.data for chunk in self._stub.get_preprocessing_state(r, timeout=timeout)), request)

    def get_task(self) -> TaskOrder:
        reply = self._call(self._stub.get_task, elasticdl_pb2.GetTaskRequest(worker_id=self.worker_id))
        return TaskOrder(
            _KINDS.get(reply.type, "wait"), reply.task_id, reply.path, reply.start, reply.end, reply.epoch,
            reply.snapshot_id, reply.model_version, reply.handout,
            (reply.read_ahead.path, reply.read_ahead.start, reply.read_ahead.end)
            if reply.HasField("read_ahead") else None,
            tuple((f.path, f.size, f.footer) for f in reply.footers),
            reply.ticket,
        )

    def report(
        self,
        task_id: int,
        records: int,
        err_message: str = "",
        loss_sum: float = 0.0,
        batches: int = 0,
        model_version: int = 0,
        metric_states: dict | None = None,
        interrupted: bool = False,
        bad_records: Sequence = (),
        diverged: bool = False,
        handout: int = 0,
    ) -> bool:
        """The task's result; ``bad_records`` (path, index, reason) found in it, skipped or not;
        ``diverged``: the loss or gradients stayed NaN/Inf, and the job must fail with ``err_message``."""
        self._progress.forget(task_id)  # the result supersedes any progress not sent yet
        reply = self._call(
            self._stub.report_task_result,
            elasticdl_pb2.ReportTaskResultRequest(
                worker_id=self.worker_id,
                task_id=task_id,
                err_message=err_message,
                records=records,
                loss_sum=loss_sum,
                batches=batches,
                model_version=model_version,
                metric_states=tensor_codec.encode_dict(metric_states or {}),
                interrupted=interrupted,
                bad_records=[elasticdl_pb2.BadRecord(path=path, index=index, reason=reason)
                             for path, index, reason in bad_records],
                diverged=diverged,
                handout=handout,
            )
        )
        if not reply.accepted:  # nothing was recorded: the master hands the task out again
            logger.warning("the master refused the report of task %d: %s", task_id, reply.reason)
        return reply.accepted

    def close(self) -> None:
        self._progress.stop()
        self._channel.close()

    def report_clock(self, clock: int, blocked_seconds: float = 0.0) -> tuple[int, int]:
        """(this worker's clock, the slowest active worker's clock) as the master counts them."""
        reply = self._call(
            self._stub.report_clock,
            elasticdl_pb2.ReportClockRequest(
                worker_id=self.worker_id, clock=clock, blocked_seconds=blocked_seconds
            )
        )
        return reply.clock, reply.slowest_clock

    def report_progress(self, task_id: int, records_done: int, model_version: int = 0) -> None:
        """Fire and forget: how far the current task got (if we die, the master knows), and
        the model version the worker holds (the master's evaluation and callbacks follow it)."""
        self._progress.post(task_id, records_done, model_version)


class _ProgressReporter:
    """Sends progress reports from one background thread, the latest one only.

    Progress is a high-water mark, so a report that is overtaken before it is sent can be
    dropped. A gRPC future per report would cost more than a small model's batch: each one
    that finds no other call in flight starts a new channel thread.
    """

    def __init__(self, stub, worker_id: int):
        self._stub = stub
        self._worker_id = worker_id
        self._latest: tuple[int, int, int] | None = None
        self._stopped = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="progress-reporter", daemon=True)
        self._thread.start()

    def post(self, task_id: int, records_done: int, model_version: int = 0) -> None:
        with self._wake:
            self._latest = (task_id, records_done, model_version)
            self._wake.notify()

    def forget(self, task_id: int) -> None:
        with self._wake:
            if self._latest is not None and self._latest[0] == task_id:
                self._latest = None

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._latest is not None or self._stopped)
                if self._stopped:
                    return
                (task_id, records_done, model_version), self._latest = self._latest, None
            try:
                self._stub.report_progress(elasticdl_pb2.ReportProgressRequest(
                    worker_id=self._worker_id, task_id=task_id, records_done=records_done,
                    model_version=model_version), timeout=MASTER_CALL_SECONDS)
            except grpc.RpcError as err:  # the master is away for a moment: the next report catches up
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the task is no longer ours
                    logger.info("progress report of task %d refused: %s", task_id, err.details())
                else:
                    logger.debug("progress report of task %d not delivered: %s", task_id, err.code())
