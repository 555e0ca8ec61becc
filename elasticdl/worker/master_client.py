"""A worker's connection to the master."""

from __future__ import annotations

from dataclasses import dataclass

from elasticdl import tensor_codec
from elasticdl.grpc_utils import make_channel, wait_for_channel
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc


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


_KINDS = {
    elasticdl_pb2.TRAINING: "training",
    elasticdl_pb2.EVALUATION: "evaluation",
    elasticdl_pb2.PREDICTION: "prediction",
    elasticdl_pb2.WAIT: "wait",
    elasticdl_pb2.END: "end",
}


class MasterClient:
    def __init__(self, address: str, worker_id: int, connect_timeout: float = 60.0):
        self.worker_id = worker_id
        self._channel = make_channel(address)
        wait_for_channel(self._channel, address, connect_timeout)
        self._stub = elasticdl_pb2_grpc.MasterStub(self._channel)

    def get_task(self) -> TaskOrder:
        reply = self._stub.get_task(elasticdl_pb2.GetTaskRequest(worker_id=self.worker_id))
        return TaskOrder(
            _KINDS.get(reply.type, "wait"), reply.task_id, reply.path, reply.start, reply.end, reply.epoch,
            reply.snapshot_id, reply.model_version,
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
    ) -> bool:
        reply = self._stub.report_task_result(
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
            )
        )
        return reply.accepted

    def close(self) -> None:
        self._channel.close()

    def report_clock(self, clock: int, blocked_seconds: float = 0.0) -> tuple[int, int]:
        """(this worker's clock, the slowest active worker's clock) as the master counts them."""
        reply = self._stub.report_clock(
            elasticdl_pb2.ReportClockRequest(
                worker_id=self.worker_id, clock=clock, blocked_seconds=blocked_seconds
            )
        )
        return reply.clock, reply.slowest_clock

    def report_progress(self, task_id: int, records_done: int) -> None:
        """Fire and forget: how far the current task got (if we die, the master knows)."""
        self._stub.report_progress.future(
            elasticdl_pb2.ReportProgressRequest(worker_id=self.worker_id, task_id=task_id, records_done=records_done)
        )
