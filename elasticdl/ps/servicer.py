"""Thin gRPC edge of the PS: messages in, ParameterServer calls, messages out."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict

import grpc
import numpy as np

from elasticdl.model.checkpoint import CheckpointError, CheckpointWriteError
from elasticdl.model.embedding.table import EmbeddingError, IndexedRows, TableInfo
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.model.optimizers import learning_rate_problem
from elasticdl.model.sharding import ps_for_variable
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer, StaleTermError
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.rpc.trust import MASTER_CREDENTIAL_HEADER

# Exported tables stream in chunks of about this many bytes (gRPC moves small messages faster).
TABLE_CHUNK_BYTES = 4 * 1024 * 1024

# What the PS takes from a request (docs/consistency.md, "What a PS accepts"); anything else is
# answered INVALID_ARGUMENT and changes nothing.
# A sync pull waits at most this long for a newer version: the worker's own wait
# (worker/worker.py SYNC_WAIT_SECONDS; a test keeps them equal). A longer one would pin a thread.
MAX_PULL_WAIT_SECONDS = 30.0
# The largest model version a pushed model may start at (every version is exact as a float).
MAX_MODEL_VERSION = 2**53
# The widest embedding row a table may declare: each table reserves 1024 rows up front.
MAX_EMBEDDING_DIM = 1 << 16


_PULL_TENSORS_FIELD = elasticdl_pb2.PullDenseParametersResponse.DESCRIPTOR.fields_by_name["dense_parameters"].number
_PUSH_TENSORS_FIELD = elasticdl_pb2.PushGradientsRequest.DESCRIPTOR.fields_by_name["gradients"].number
_PUSH_REPLY_TENSORS_FIELD = elasticdl_pb2.PushGradientsResponse.DESCRIPTOR.fields_by_name["dense_parameters"].number
# The protocol's enum, member for member by name (a missing member fails here, at import).
_OUTCOME_NUMBERS = {outcome: elasticdl_pb2.PushOutcome.Value(outcome.name) for outcome in PushOutcome}


class PServerServicer(elasticdl_pb2_grpc.PServerServicer):
    """Serve with ``grpc_utils.add_service(server, "PServer", servicer)``: a pull answers in bytes."""

    # Streamed gradients arrive as bytes: their tensors are read as views, not copied twice.
    RAW_REQUESTS = frozenset({"push_gradients_stream"})

    def __init__(self, server: ParameterServer):
        self._server = server
        self.bulk_port = 0  # the port of its raw-TCP transport (ps/bulk_server.py), once started
        self.bulk_host = ""  # the address it listens on

    def _check_master(self, context) -> None:
        """PERMISSION_DENIED unless the call carries the master's credential (a PS with the job
        key): checkpoints, restores, fences, live workers, snapshots and the rate are the master's."""
        verifier = self._server.verifier
        if verifier is None:
            return
        sent = dict(context.invocation_metadata() or ()).get(MASTER_CREDENTIAL_HEADER, "")
        problem = verifier.master_problem(str(sent))
        if problem:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)

    @property
    def model_bytes(self) -> int:
        """Bytes of this PS's dense parameters: no push or pull carries more."""
        return sum(value.nbytes for value in self._server.shard.params.values())

    def push_model(self, request, context):
        params = _decode_or_abort(request.dense_parameters, context, writable=True)
        settings = self._server.settings
        declared, non_trainable = list(request.variables), list(request.non_trainable)
        problem = (_model_problem(request.version, params, declared, settings.ps_id, settings.num_ps)
                   or _non_trainable_problem(non_trainable, declared))
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model refused: {problem}")
        accepted, version = self._server.push_model(params, request.version, non_trainable)
        return elasticdl_pb2.PushModelResponse(accepted=accepted, version=version)

    def pull_dense_parameters(self, request, context):
        return self.pull_with(request, context, _encode_pull)

    def pull_dense_parameters_stream(self, request, context):
        # Serialized under the PS lock (the one copy), sent after it is released.
        yield from self.pull_with(request, context, _encode_pull_chunks)

    def pull_with(self, request, context, encode):
        """Answer a pull request as ``encode(initialized, version, params, wire_dtype=...)``
        (called under the PS lock on the live arrays: they must be copied there)."""
        problem = _pull_problem(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        encode = functools.partial(encode, wire_dtype=request.wire_dtype or "float32")
        if request.snapshot_id > 0:
            try:
                return encode(*self._server.pull_snapshot(request.snapshot_id))
            except KeyError as err:
                context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        return self._server.pull(request.version, request.wait_for_newer, request.timeout_seconds, encode)

    def push_gradients(self, request, context):
        _check_wire_dtype(request.wire_dtype, context)  # before anything is decoded
        return self.push_arrays(request, _decode_or_abort(request.gradients, context), context)

    def push_gradients_stream(self, request_iterator, context):
        """The first request carries the header, the embedding rows and the non-trainable changes;
        every one, tensor pieces (anything else in a later one is ignored)."""
        head, assembler = None, tensor_codec.TensorAssembler()
        try:
            for data in request_iterator:
                request, gradients = tensor_codec.parse_with_tensors(
                    data, elasticdl_pb2.PushGradientsRequest, _PUSH_TENSORS_FIELD
                )
                if head is None:
                    head = request
                    _check_wire_dtype(head.wire_dtype, context)
                assembler.add(gradients)
            grads = dict(assembler.result())
        except tensor_codec.TensorDecodeError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if head is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty push: no request arrived")
        return self.push_arrays(head, grads, context)

    def push_arrays(self, head, grads, context):
        """Apply a push whose dense gradients ``grads`` are arrays already (``head``: the rest)."""
        grads = tensor_codec.widened(grads)  # float16 on the wire (--wire_dtype): float32 on the PS
        for rows in head.embedding_gradients:
            if rows.name in grads:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rows.name!r} appears twice in one push")
            grads[rows.name] = _decode_rows_or_abort(rows, context)
        for name, change in _decode_or_abort(head.non_trainable_changes, context).items():
            if name in grads:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{name!r} appears twice in one push (a gradient and a non-trainable change)")
            grads[name] = NonTrainableChange(change)
        # Absent: the master's or the optimizer's rate; 0 is a rate (no update). The core refuses a bad one.
        lr = head.learning_rate if head.HasField("learning_rate") else None
        # Asked for (a unary push of a small model), the new parameters are written into the
        # reply under the PS lock, as a pull would: the worker then skips its next pull.
        encode = (functools.partial(_encode_push_reply, wire_dtype=head.wire_dtype or "float32")
                  if head.return_parameters else None)
        batch = None
        if head.task_id or head.handout or head.records_end or head.records or head.ticket:
            batch = BatchPosition(head.task_id, head.handout, head.records_end, head.records, head.ticket)
        try:
            result = self._server.push_gradients(grads, head.version, lr, encode, batch, head.worker_id)
        except EmbeddingError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return result if encode is not None else _push_reply(result)

    def save_checkpoint(self, request, context):
        self._check_master(context)
        if request.at_version < 0 or request.term < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "at_version and term are never negative")
        try:
            if request.at_version:
                path = self._server.checkpoint_at(request.at_version, request.term)
            else:
                self._server.check_term(request.term)
                path = self._server.save_checkpoint()
        except StaleTermError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except CheckpointWriteError as err:  # a full disk, an unwritable directory: no partial file
            context.abort(grpc.StatusCode.INTERNAL, str(err))
        except CheckpointError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return elasticdl_pb2.SaveCheckpointResponse(path=path, version=self._server.shard.version)

    def restore(self, request, context):
        self._check_master(context)
        if request.term < 0 or request.fence < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "term and fence are never negative")
        try:
            version = self._server.roll_back(request.path, request.term, request.fence)
        except StaleTermError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except CheckpointError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return elasticdl_pb2.RestoreResponse(version=version)

    def fence(self, request, context):
        self._check_master(context)
        if (request.term < 0 or request.done_below < 0 or any(h < 0 for h in request.handouts)
                or any(t < 0 for t in request.task_ids)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "term, hand-outs, task ids and done_below are never negative")
        try:
            marks = self._server.fence(list(request.handouts), list(request.task_ids), request.term,
                                       request.done_below)
        except StaleTermError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return elasticdl_pb2.FenceResponse(
            marks=[elasticdl_pb2.TaskMark(task_id=t, records_end=e) for t, e in sorted(marks.items())]
        )

    def level_version(self, request, context):
        self._check_master(context)
        if request.version < 0 or request.term < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version and term are never negative")
        try:
            version = self._server.level_version(request.version, request.term)
        except (StaleTermError, ValueError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return elasticdl_pb2.RestoreResponse(version=version)

    def take_snapshot(self, request, context):
        self._check_master(context)
        _check_snapshot_id(request.snapshot_id, context)
        version = self._server.take_snapshot(request.snapshot_id)
        return elasticdl_pb2.Snapshot(snapshot_id=request.snapshot_id, version=version)

    def drop_snapshot(self, request, context):
        self._check_master(context)
        _check_snapshot_id(request.snapshot_id, context)
        self._server.drop_snapshot(request.snapshot_id)
        return elasticdl_pb2.Empty()

    def set_learning_rate(self, request, context):
        self._check_master(context)
        value = request.value if request.HasField("value") else None  # absent: the optimizer's own
        problem = learning_rate_problem(value) if value is not None else ""
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{problem}; the rate in use is unchanged")
        try:
            self._server.set_learning_rate(value, request.term)
        except StaleTermError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return elasticdl_pb2.Empty()

    def push_embedding_table_infos(self, request, context):
        try:
            for table in request.tables:
                if table.dim > MAX_EMBEDDING_DIM:
                    raise EmbeddingError(
                        f"embedding table {table.name!r}: dim {table.dim} is above {MAX_EMBEDDING_DIM}, "
                        "the widest row a parameter server takes"
                    )
            infos = [TableInfo.from_json(t.name, t.dim, t.initializer) for t in request.tables]
            self._server.push_embedding_table_infos(infos)
        except EmbeddingError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return elasticdl_pb2.Empty()

    def pull_embedding_vectors(self, request, context):
        if request.snapshot_id < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"snapshot_id {request.snapshot_id} is negative "
                          "(0: the live rows, > 0: an evaluation snapshot's)")
        try:
            ids = tensor_codec.decode(request.ids)
        except tensor_codec.TensorDecodeError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"embedding table {request.name!r}: {err}")
        try:
            rows = self._server.lookup_embeddings(request.name, ids, request.create, request.snapshot_id)
        except EmbeddingError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except KeyError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err.args[0]))
        return tensor_codec.encode(request.name, rows)

    def pull_embedding_table(self, request, context):
        if request.rows_per_chunk < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rows_per_chunk {request.rows_per_chunk} is negative (0: chunks of about 4 MB)")
        try:
            ids, rows = self._server.embedding_table(request.name)
        except EmbeddingError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        step = request.rows_per_chunk or max(1, TABLE_CHUNK_BYTES // (4 * rows.shape[1] + 8))
        for start in range(0, max(len(ids), 1), step):
            yield elasticdl_pb2.IndexedRows(
                name=request.name,
                ids=tensor_codec.encode("ids", ids[start:start + step]),
                values=tensor_codec.encode("values", rows[start:start + step]),
            )

    def set_live_workers(self, request, context):
        self._check_master(context)
        if request.count < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"live worker count {request.count} is negative")
        self._server.set_live_workers(request.count)
        return elasticdl_pb2.Empty()

    def get_stats(self, request, context):
        version, telemetry, grads_to_wait = self._server.stats()
        checkpoint_failures, checkpoint_error = self._server.checkpoint_health()
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
            checkpoint_failures=checkpoint_failures,
            checkpoint_error=checkpoint_error,
            records_applied=self._server.position.records_applied,
            term=self._server.term,
            bulk_port=self.bulk_port,
            bulk_host=self.bulk_host,
            gradients_refused=self._server.guard.refused,
            embedding_tables=[
                elasticdl_pb2.EmbeddingTableStats(name=t.name, rows=t.rows, bytes=t.bytes, **asdict(t.counters))
                for t in self._server.embedding_stats()
            ],
        )


def _encode_pull(initialized: bool, version: int, params, wire_dtype: str) -> bytes:
    head = elasticdl_pb2.PullDenseParametersResponse(initialized=initialized, version=version)
    return tensor_codec.serialize_with_tensors(head, _PULL_TENSORS_FIELD, params, wire_dtype)


def _push_reply(result) -> elasticdl_pb2.PushGradientsResponse:
    return elasticdl_pb2.PushGradientsResponse(
        accepted=result.accepted, version=result.version, reason=result.reason, applied=result.applied,
        outcome=_OUTCOME_NUMBERS[result.outcome],
    )


def _encode_push_reply(result, params, wire_dtype: str) -> bytes:
    head = _push_reply(result)
    if params is None:
        return head.SerializeToString()
    head.has_parameters = True
    return tensor_codec.serialize_with_tensors(head, _PUSH_REPLY_TENSORS_FIELD, params, wire_dtype)


def _encode_pull_chunks(initialized: bool, version: int, params, wire_dtype: str) -> list[bytes]:
    head = elasticdl_pb2.PullDenseParametersResponse(initialized=initialized, version=version)
    return tensor_codec.serialize_chunks(head, _PULL_TENSORS_FIELD, params, wire_dtype=wire_dtype)


def _decode_rows_or_abort(message, context) -> IndexedRows:
    try:
        return IndexedRows(tensor_codec.decode(message.ids), tensor_codec.decode(message.values))
    except tensor_codec.TensorDecodeError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"embedding table {message.name!r}: {err}")


def _decode_or_abort(tensors, context, writable: bool = False):
    try:
        return tensor_codec.decode_list(tensors, writable)
    except tensor_codec.TensorDecodeError as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


def _check_wire_dtype(wire_dtype: str, context) -> None:
    problem = tensor_codec.wire_dtype_problem(wire_dtype)
    if problem:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _pull_problem(request) -> str:
    problem = tensor_codec.wire_dtype_problem(request.wire_dtype)
    if problem:
        return problem
    if request.version < -1:
        return f"version {request.version} is below -1 (-1: send every parameter)"
    timeout = request.timeout_seconds
    if not math.isfinite(timeout) or not 0 <= timeout <= MAX_PULL_WAIT_SECONDS:
        return (
            f"timeout_seconds {timeout} is not between 0 and {MAX_PULL_WAIT_SECONDS:g} "
            "(a pull waits at most that long for a newer version; ask again after it)"
        )
    if request.snapshot_id < 0:
        return f"snapshot_id {request.snapshot_id} is negative (0: the live model, > 0: an evaluation snapshot)"
    return ""


def _check_snapshot_id(snapshot_id: int, context) -> None:
    if snapshot_id <= 0:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"snapshot_id {snapshot_id} is not positive (the master numbers rounds from 1)")


def _non_trainable_problem(non_trainable: list[str], declared: list[str]) -> str:
    """Why a model's `non_trainable` names are not ones a worker sends ('' when they are)."""
    if len(set(non_trainable)) != len(non_trainable):
        return "`non_trainable` must name each non-trainable variable once"
    unknown = sorted(set(non_trainable) - set(declared))
    if unknown:
        return f"non-trainable {unknown[:3]} are not among the model's declared `variables`"
    return ""


def _model_problem(version: int, params: dict[str, np.ndarray], declared: list[str], ps_id: int, num_ps: int) -> str:
    """Why a pushed model is not one a PS takes ('' when it is): the rule of the Model message."""
    if not 0 <= version <= MAX_MODEL_VERSION:
        return f"version {version} is not between 0 and 2**53"
    if len(set(declared)) != len(declared) or not all(declared):
        return "`variables` must name each variable of the model once, none empty"
    undeclared = sorted(set(params) - set(declared))
    if undeclared:
        return f"{undeclared[:3]} are not among the model's declared `variables`"
    foreign = sorted(n for n in params if ps_for_variable(n, num_ps) != ps_id)
    if foreign:
        return f"{foreign[:3]} belong to PS {ps_for_variable(foreign[0], num_ps)}, not to PS {ps_id}"
    missing = sorted(n for n in declared if ps_for_variable(n, num_ps) == ps_id and n not in params)
    if missing:
        return (f"a partial model: {len(missing)} of this PS's variables are missing ({', '.join(missing[:3])}); "
                "push every variable of the model at once")
    for name, value in params.items():
        if value.dtype.kind != "f":
            return f"variable {name!r} has dtype {value.dtype}, expected float"
        with np.errstate(over="ignore"):
            if not np.isfinite(value.astype(np.float32, copy=False)).all():
                return f"variable {name!r} contains NaN or Inf (or a value beyond float32)"
    return ""
