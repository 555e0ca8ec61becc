"""Thin gRPC edge of the PS: messages in, ParameterServer calls, messages out."""

from __future__ import annotations

import grpc

from elasticdl import tensor_codec
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer


class PServerServicer(elasticdl_pb2_grpc.PServerServicer):
    def __init__(self, server: ParameterServer):
        self._server = server

    def push_model(self, request, context):
        params = _decode_or_abort(request.dense_parameters, context, writable=True)
        accepted, version = self._server.push_model(params, request.version)
        return elasticdl_pb2.PushModelResponse(accepted=accepted, version=version)

    def pull_dense_parameters(self, request, context):
        if request.snapshot_id > 0:
            try:
                initialized, version, params = self._server.pull_snapshot(request.snapshot_id)
            except KeyError as err:
                context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        else:
            initialized, version, params = self._server.pull(
                request.version, request.wait_for_newer, request.timeout_seconds
            )
        return elasticdl_pb2.PullDenseParametersResponse(
            initialized=initialized,
            version=version,
            dense_parameters=tensor_codec.encode_dict(params),
        )

    def push_gradients(self, request, context):
        grads = _decode_or_abort(request.gradients, context)
        lr = request.learning_rate if request.learning_rate > 0 else None
        result = self._server.push_gradients(grads, request.version, lr)
        return elasticdl_pb2.PushGradientsResponse(
            accepted=result.accepted, version=result.version, reason=result.reason, applied=result.applied
        )

    def save_checkpoint(self, request, context):
        path = self._server.save_checkpoint()
        return elasticdl_pb2.SaveCheckpointResponse(path=path, version=self._server.shard.version)

    def take_snapshot(self, request, context):
        version = self._server.take_snapshot(request.snapshot_id)
        return elasticdl_pb2.Snapshot(snapshot_id=request.snapshot_id, version=version)

    def drop_snapshot(self, request, context):
        self._server.drop_snapshot(request.snapshot_id)
        return elasticdl_pb2.Empty()

    def set_learning_rate(self, request, context):
        self._server.set_learning_rate(request.value if request.value > 0 else None)
        return elasticdl_pb2.Empty()

    def set_live_workers(self, request, context):
        self._server.set_live_workers(request.count)
        return elasticdl_pb2.Empty()

    def get_stats(self, request, context):
        version, telemetry, grads_to_wait = self._server.stats()
        return elasticdl_pb2.PSStats(
            version=version,
            pushes_accepted=telemetry.pushes_accepted,
            pushes_rejected_stale=telemetry.pushes_rejected_stale,
            pushes_rejected_invalid=telemetry.pushes_rejected_invalid,
            staleness=[
                elasticdl_pb2.StalenessCount(staleness=k, count=v)
                for k, v in sorted(telemetry.staleness.items())
            ],
            grads_to_wait=grads_to_wait,
        )


def _decode_or_abort(tensors, context, writable: bool = False):
    try:
        return tensor_codec.decode_list(tensors, writable)
    except tensor_codec.TensorDecodeError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

