"""Thin gRPC edge of the master: translate messages, call the task manager."""

from __future__ import annotations

from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.task_manager import NoTask, TaskManager, TaskType
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc

_TASK_TYPES = {
    TaskType.TRAINING: elasticdl_pb2.TRAINING,
    TaskType.EVALUATION: elasticdl_pb2.EVALUATION,
    TaskType.PREDICTION: elasticdl_pb2.PREDICTION,
}


class MasterServicer(elasticdl_pb2_grpc.MasterServicer):
    def __init__(self, task_manager: TaskManager, progress: TrainingProgress, clocks: WorkerClocks):
        self._tasks = task_manager
        self._progress = progress
        self._clocks = clocks

    def get_task(self, request, context):
        task = self._tasks.get_task(request.worker_id)
        if task is NoTask.WAIT:
            return elasticdl_pb2.Task(type=elasticdl_pb2.WAIT)
        if task is NoTask.END:
            return elasticdl_pb2.Task(type=elasticdl_pb2.END)
        return elasticdl_pb2.Task(
            task_id=task.task_id,
            type=_TASK_TYPES[task.type],
            path=task.shard.path,
            start=task.shard.start,
            end=task.shard.end,
            epoch=task.epoch,
        )

    def report_task_result(self, request, context):
        outcome = self._tasks.report(
            request.task_id, request.worker_id, request.err_message, request.records
        )
        if outcome.accepted and not request.err_message:
            self._progress.record(
                request.records, request.loss_sum, request.batches, request.model_version
            )
        return elasticdl_pb2.ReportTaskResultResponse(
            accepted=outcome.accepted, reason=outcome.reason
        )

    def report_clock(self, request, context):
        view = self._clocks.report(
            request.worker_id, request.clock, self._tasks.active_workers(), request.blocked_seconds
        )
        return elasticdl_pb2.ReportClockResponse(
            clock=view.clock, slowest_clock=view.slowest, fastest_clock=view.fastest
        )
