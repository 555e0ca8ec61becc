"""A worker's view of all parameter servers: pulls and pushes go to every PS in parallel."""

from __future__ import annotations

import functools
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from elasticdl.model.embedding.table import EmbeddingError, IndexedRows, TableInfo
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.model.sharding import partition_ids, ps_for_variable
from elasticdl.model.slicing import DenseSlicing, sliced_names
from elasticdl.proto import elasticdl_pb2
from elasticdl.rpc import bulk
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.auth import HeaderCallInterceptor, job_token
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.channel import ServiceStub, make_channel, wait_for_channel
from elasticdl.rpc.ps_commands import MasterCommands, PSStats  # noqa: F401 (PSStats re-exported)
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.rpc.replica_commands import Routes, ShardRoutes
from elasticdl.rpc.trust import MASTER_CREDENTIAL_HEADER

logger = logging.getLogger(__name__)

_MODEL_TENSORS_FIELD = elasticdl_pb2.Model.DESCRIPTOR.fields_by_name["dense_parameters"].number
_PULL_TENSORS_FIELD = elasticdl_pb2.PullDenseParametersResponse.DESCRIPTOR.fields_by_name["dense_parameters"].number
_RAW_RESPONSES = frozenset({"pull_dense_parameters_stream"})
_PUSH_TENSORS_FIELD = elasticdl_pb2.PushGradientsRequest.DESCRIPTOR.fields_by_name["gradients"].number
# A PS's part of the model larger than this travels in 1 MB streamed messages; a smaller one
# in one message (a streamed call costs 1-3 ms more than a unary one in Python gRPC).
STREAM_ABOVE_BYTES = 4 << 20
# --tensor_transport tcp: a PS's raw-TCP port is connected to within this; one that cannot be
# is not tried again for BULK_RETRY_SECONDS (its calls go over gRPC meanwhile), so an
# unreachable port costs a call its connect timeout once, not every call.
BULK_CONNECT_SECONDS = 5.0
BULK_RETRY_SECONDS = 30.0
# A waiting pull that a PS answered "not yet" (the model did not move; the PS lets only a few
# pulls wait at once, each briefly: elasticdl/ps/server.py MAX_WAITING_PULLS) asks again,
# at most every POLL_FIRST_SECONDS at first, then less often, at least every
# POLL_MAX_SECONDS, until the model moves or the caller's timeout passes.
POLL_FIRST_SECONDS = 0.01
POLL_MAX_SECONDS = 0.1
# The protocol's enum, member for member by name (a missing member fails here, at import).
_OUTCOMES = {elasticdl_pb2.PushOutcome.Value(outcome.name): outcome for outcome in PushOutcome}


@dataclass(frozen=True)
class PullResult:
    initialized: bool
    version: int
    params: dict[str, np.ndarray]


@dataclass(frozen=True)
class PushAnswer:
    outcome: PushOutcome
    version: int
    reason: str = ""  # for people (logs, errors); decisions go by `outcome`
    # The PS's parameters at `version`, when asked for and this push made that version.
    params: dict[str, np.ndarray] | None = None

    @property
    def accepted(self) -> bool:
        return self.outcome.accepted

    @property
    def applied(self) -> bool:
        return self.outcome.applied




class PSClient(MasterCommands, ShardRoutes):
    def __init__(
        self, addresses: list[str], connect_timeout: float = 60.0, token: str | None = None,
        wire_dtype: str = "float32", tensor_transport: str = "grpc", master_credential: str = "",
        replicas: int = 0, slice_dense_above_mb: float = -1.0,
    ):
        """``token``: the job's (default: the one in ``$ELASTICDL_TOKEN_FILE``). ``wire_dtype``
        (--wire_dtype): what dense float32 gradients and parameters travel as; the PS keeps
        float32, and the parameters come back as float32. Evaluation snapshots, the model
        pushed at the start, embedding rows and non-trainable changes always travel as float32.
        ``tensor_transport`` (--tensor_transport): "tcp" sends the streamed pulls and pushes
        (parts above STREAM_ABOVE_BYTES) as raw frames (elasticdl/rpc/bulk.py) to each PS that
        serves them; "grpc", or a PS without such a port, streams them over gRPC.
        ``master_credential``: the master's (elasticdl/rpc/trust.py), which its commands need.
        ``replicas`` (--ps_replicas): calls follow each shard's primary (``reroute``).
        ``slice_dense_above_mb`` (--slice_dense_above_mb; negative: never): larger dense
        variables travel as one slice per PS (elasticdl/model/slicing.py)."""
        problem = tensor_codec.wire_dtype_problem(wire_dtype)
        if problem:
            raise ValueError(f"--{problem}")
        self.wire_dtype = wire_dtype or "float32"
        if tensor_transport not in ("grpc", "tcp"):
            raise ValueError(f"--tensor_transport must be grpc or tcp. Received: {tensor_transport!r}")
        self.tensor_transport = tensor_transport
        self._token = token
        if self.wire_dtype != "float32":
            logger.info("--wire_dtype=%s: dense gradients and parameters travel as %s, the PS keeps float32",
                        self.wire_dtype, self.wire_dtype)
        self.addresses = addresses
        self.slicing = DenseSlicing.from_flag(slice_dense_above_mb, len(addresses))
        self._channels = [make_channel(a, token) for a in addresses]
        if master_credential:
            header = HeaderCallInterceptor(MASTER_CREDENTIAL_HEADER, master_credential)
            self._channels = [grpc.intercept_channel(c, header) for c in self._channels]
        for channel, address in zip(self._channels, addresses):
            wait_for_channel(channel, address, connect_timeout)
        # Streamed pulls answer in bytes: their tensors are read as views, not copied twice.
        self._raw_responses = _RAW_RESPONSES
        self._stubs = [ServiceStub(c, "PServer", raw_responses=_RAW_RESPONSES) for c in self._channels]
        # --ps_replicas: shard i's calls go to its primary's PS (elasticdl/rpc/replica_commands.py).
        self.routes = Routes.initial(len(addresses)) if replicas else None
        # Bytes of each PS's last pull of the whole model (None: not known yet, so it streams).
        self._pull_bytes: list[int | None] = [None] * len(addresses)
        self._pool: ThreadPoolExecutor | None = None  # made when a call goes to several PS
        # --tensor_transport tcp: each PS's connection, made at its first large call (None: not
        # yet; False: the PS serves none), and a lock per PS (one request at a time on it).
        self._bulk: list = [None] * len(addresses)
        self._bulk_retry_at = [0.0] * len(addresses)  # after a failed connect: gRPC until then
        self._bulk_locks = [threading.Lock() for _ in addresses]
        # The master's leadership term: its commands carry it, and a PS refuses an older one.
        self.term = 0

    @property
    def num_ps(self) -> int:
        return len(self._stubs)

    def split(self, arrays: dict[str, np.ndarray | IndexedRows]) -> list[dict[str, np.ndarray | IndexedRows]]:
        """Dense arrays by name hash, or their slices one per PS; embedding rows (IndexedRows) by id % num_ps."""
        parts: list[dict] = [{} for _ in self._stubs]
        for name, value in arrays.items():
            if isinstance(value, IndexedRows):
                for ps, positions in enumerate(partition_ids(value.ids, self.num_ps)):
                    if positions.size:
                        parts[ps][name] = IndexedRows(value.ids[positions], value.values[positions])
            else:
                for piece_name, piece in self.slicing.pieces(name, value):
                    parts[ps_for_variable(piece_name, self.num_ps)][piece_name] = piece
        return parts

    def pull(
        self, versions: list[int], wait_for_newer: list[bool] | None = None, timeout: float = 30.0
    ) -> list[PullResult]:
        """Pull from every PS; where ``wait_for_newer[i]``, PS i answers once its model moved
        past ``versions[i]``, or with ``versions[i]`` once ``timeout`` seconds passed."""
        waits = wait_for_newer or [False] * len(versions)
        return self._each([
            functools.partial(self._pull_newer, ps, v, timeout) if w else
            functools.partial(self._pull_one, ps, elasticdl_pb2.PullDenseParametersRequest(
                version=v, wire_dtype=self._wire_dtype_field))
            for ps, (v, w) in enumerate(zip(versions, waits))
        ])

    def _pull_newer(self, ps: int, version: int, timeout: float) -> PullResult:
        """Ask PS ``ps`` until its model moved past ``version`` or ``timeout`` passed.

        Each call may wait on the PS for a while, or be answered "not yet" at once; the next
        asks no sooner than the current poll interval (jittered) after the previous began.
        """
        deadline = time.monotonic() + timeout
        interval = POLL_FIRST_SECONDS
        while True:
            began = time.monotonic()
            result = self._pull_one(ps, elasticdl_pb2.PullDenseParametersRequest(
                version=version, wait_for_newer=True, timeout_seconds=max(deadline - began, 0.0),
                wire_dtype=self._wire_dtype_field,
            ))
            now = time.monotonic()
            if result.version != version or not result.initialized or now >= deadline:
                return result
            pause = min(began + random.uniform(0.5, 1.0) * interval, deadline) - now
            if pause > 0:
                time.sleep(pause)
            interval = min(interval * 2, POLL_MAX_SECONDS)

    def pull_snapshot(self, snapshot_id: int) -> list[PullResult]:
        request = elasticdl_pb2.PullDenseParametersRequest(snapshot_id=snapshot_id)
        return self._each([functools.partial(self._pull_one, ps, request) for ps in range(self.num_ps)])

    def _pull_one(self, ps: int, request) -> PullResult:
        """One PS's parameters: streamed in 1 MB messages unless its part is known to be small."""
        stub = self._stubs[ps]
        known = self._pull_bytes[ps]
        if known is not None and known <= STREAM_ABOVE_BYTES:
            head = stub.pull_dense_parameters(request)
            params = tensor_codec.decode_list(head.dense_parameters)
        elif self.tensor_transport == "tcp" and (answer := self._bulk_call(ps, bulk.PULL, request)) is not None:
            head, params = answer
        else:
            head, assembler = None, tensor_codec.TensorAssembler()
            for data in stub.pull_dense_parameters_stream(request):
                reply, tensors = tensor_codec.parse_with_tensors(
                    data, elasticdl_pb2.PullDenseParametersResponse, _PULL_TENSORS_FIELD
                )
                if head is None:
                    head = reply
                assembler.add(tensors)
            if head is None:
                raise ConnectionError(f"PS {ps} at {self.addresses[ps]} ended a pull without an answer")
            params = assembler.result()
        params = tensor_codec.widened(params)  # float16 on the wire (--wire_dtype): float32 here
        if params:
            self._pull_bytes[ps] = sum(a.nbytes for a in params.values())
        return PullResult(head.initialized, head.version, params)

    @property
    def _wire_dtype_field(self) -> str:
        return "" if self.wire_dtype == "float32" else self.wire_dtype  # float32: as before, no field

    def push_model(self, params: dict[str, np.ndarray], version: int = 0, non_trainable=()) -> list[bool]:
        """Give every PS its part of the model; each checks it got all of its part of ``params``.
        ``non_trainable``: the names among ``params`` that are non-trainable state."""
        parts = self.split(params)
        head = elasticdl_pb2.Model(version=version, variables=sorted(n for part in parts for n in part),
                                   non_trainable=sliced_names(non_trainable, parts))
        futures = [
            stub.push_model.future(tensor_codec.serialize_with_tensors(head, _MODEL_TENSORS_FIELD, part))
            for stub, part in zip(self._stubs, parts)
        ]
        return [f.result().accepted for f in futures]

    def push_gradients(
        self,
        grads_by_ps: dict[int, dict[str, np.ndarray]],
        versions: list[int],
        learning_rate: float | None,
        worker_id: int,
        want_parameters: bool = False,
        batch: BatchPosition | None = None,
    ) -> dict[int, PushAnswer]:
        """Push each PS its part (every PS gets a push, even an empty one, so versions stay in step).

        With ``want_parameters``, a PS whose part of the model is known to be small answers a
        push that made a new version with that version's parameters (``PushAnswer.params``).
        """
        answers = self._each([
            functools.partial(self._push_one, ps, part, versions[ps], learning_rate, worker_id, want_parameters, batch)
            for ps, part in grads_by_ps.items()
        ])
        return dict(zip(grads_by_ps, answers))

    def _push_one(
        self, ps: int, part: dict, version: int, learning_rate: float | None, worker_id: int, want_parameters: bool,
        batch: BatchPosition | None = None,
    ) -> PushAnswer:
        """Dense gradients larger than STREAM_ABOVE_BYTES stream in 1 MB messages (the non-trainable
        changes, small, go in the first)."""
        dense = {n: v for n, v in part.items() if not isinstance(v, (IndexedRows, NonTrainableChange))}
        head = elasticdl_pb2.PushGradientsRequest(
            worker_id=worker_id,
            version=version,
            learning_rate=learning_rate,
            embedding_gradients=[_encode_rows(n, v) for n, v in part.items() if isinstance(v, IndexedRows)],
            non_trainable_changes=[
                tensor_codec.encode(n, v.values) for n, v in part.items() if isinstance(v, NonTrainableChange)
            ],
        )
        if batch is not None:
            head.task_id, head.handout = batch.task_id, batch.handout
            head.records_end, head.records = batch.records_end, batch.records
            head.ticket = batch.ticket  # the master's signature of the hand-out: the PS checks it
        stub = self._stubs[ps]
        wire = self.wire_dtype
        large = sum(np.asarray(v).nbytes for v in dense.values()) > STREAM_ABOVE_BYTES
        sent = None
        if large and self.tensor_transport == "tcp":
            try:
                sent = self._bulk_call(ps, bulk.PUSH, head, dense)
            except bulk.PushMaybeApplied as err:
                if batch is None or not batch.task_id:
                    raise  # without its task's place, a second send could apply it twice
                # The PS keeps how far each task's gradients were applied: sent again (over
                # gRPC), a push it applied already is answered as applied and not applied again.
                logger.warning("%s; sent again over gRPC", err)
        if sent is not None:
            reply = sent[0]
        elif large:
            later = elasticdl_pb2.PushGradientsRequest(worker_id=worker_id, version=version)
            # Written as they are sent: the gradients are ours and do not change meanwhile.
            reply = stub.push_gradients_stream(
                tensor_codec.iter_chunks(head, _PUSH_TENSORS_FIELD, dense, later, wire_dtype=wire)
            )
        else:
            known = self._pull_bytes[ps]
            head.return_parameters = want_parameters and known is not None and known <= STREAM_ABOVE_BYTES
            head.wire_dtype = self._wire_dtype_field
            reply = stub.push_gradients(tensor_codec.serialize_with_tensors(head, _PUSH_TENSORS_FIELD, dense, wire))
        params = tensor_codec.widened(tensor_codec.decode_list(reply.dense_parameters)) if reply.has_parameters else None
        # A number this client does not know (a newer PS) reads as unspecified: an error to the worker.
        outcome = _OUTCOMES.get(reply.outcome, PushOutcome.PUSH_OUTCOME_UNSPECIFIED)
        return PushAnswer(outcome, reply.version, reply.reason, params)

    # ------------------------------------------------------------ --tensor_transport tcp

    def _bulk_connection(self, ps: int):
        """PS ``ps``'s bulk socket, connected and authenticated (None if it serves none)."""
        conn = self._bulk[ps]
        if conn is None:
            if time.monotonic() < self._bulk_retry_at[ps]:
                return None  # it could not be reached a moment ago: gRPC until then
            stats = self._stubs[ps].get_stats(elasticdl_pb2.Empty())
            port = stats.bulk_port
            if not port:
                logger.warning("PS %d at %s serves no raw-TCP transport (its job has --tensor_transport grpc): "
                               "its tensors go over gRPC", ps, self.addresses[ps])
                self._bulk[ps] = False
                return None
            token = self._token or job_token()
            if not token:
                raise bulk.BulkProtocolError("--tensor_transport tcp needs the job's token ($ELASTICDL_TOKEN_FILE)")
            # The PS's own address (its pod's IP), not its Service's, which carries only gRPC.
            host = stats.bulk_host or self.addresses[ps].rsplit(":", 1)[0]
            try:
                conn = socket.create_connection((host, port), timeout=BULK_CONNECT_SECONDS)
            except OSError:
                self._bulk_retry_at[ps] = time.monotonic() + BULK_RETRY_SECONDS
                raise
            conn.settimeout(None)
            bulk.tune(conn)
            bulk.send_frame(conn, bulk.AUTH, token.encode())
            self._bulk[ps] = conn
        return conn or None

    def _bulk_call(self, ps: int, kind: int, head, dense: dict | None = None):
        """A pull (``(head, params)``) or a push (``(reply,)``) as one frame each way.

        A pull that meets a broken connection returns None (the caller pulls over gRPC), as does
        a push that could not start; a push that broke once sent raises PushMaybeApplied: the PS
        may have applied it (the caller sends it again only with its task's place).
        """
        with self._bulk_locks[ps]:
            sending = False
            try:
                conn = self._bulk_connection(ps)
                if conn is None:
                    return None
                sending = True
                if kind == bulk.PUSH:
                    metas, arrays = bulk.tensor_metas(dense, self.wire_dtype)
                    framed = elasticdl_pb2.PushGradientsRequest()
                    framed.CopyFrom(head)  # the head stays as it was, to be sent again over gRPC
                    framed.gradients.extend(metas)
                    bulk.send_frame(conn, kind, framed.SerializeToString(), arrays)
                else:
                    bulk.send_frame(conn, kind, head.SerializeToString())
                answer_kind, answer = bulk.recv_head(conn)
                if answer_kind == bulk.ERROR:
                    code, _, details = answer.decode("utf-8", "replace").partition(":")
                    self._drop_bulk(ps)  # the PS may close it after a refused push: start afresh
                    if code == grpc.StatusCode.INVALID_ARGUMENT.name:
                        raise EmbeddingError(f"the parameter server refused it: {details}")
                    raise bulk.BulkRefused(code, details)
                if kind == bulk.PUSH:
                    return (elasticdl_pb2.PushGradientsResponse.FromString(answer),)
                reply = elasticdl_pb2.PullDenseParametersResponse.FromString(answer)
                return reply, bulk.recv_arrays(conn, bulk.plan(reply.dense_parameters)[0])
            except (OSError, tensor_codec.TensorDecodeError) as err:
                self._drop_bulk(ps)
                if kind == bulk.PUSH and sending:
                    raise bulk.PushMaybeApplied(
                        f"PS {ps} at {self.addresses[ps]}: the raw-TCP push broke once sent ({err})") from err
                logger.warning("PS %d: the raw-TCP call failed (%s); it goes over gRPC", ps, err)
                return None

    def _drop_bulk(self, ps: int) -> None:
        conn, self._bulk[ps] = self._bulk[ps], None
        if conn:
            conn.close()

    def _each(self, calls: list) -> list:
        """Run one call per PS in parallel (the last in this thread); their results in order.

        INVALID_ARGUMENT (bad embedding input) becomes EmbeddingError.
        """
        try:
            if len(calls) > 1 and self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.num_ps, thread_name_prefix="ps-call")
            futures = [self._pool.submit(call) for call in calls[:-1]]
            last = [call() for call in calls[-1:]]
            return [future.result() for future in futures] + last
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.refresh_routes()  # --ps_replicas: the retry goes to the shard's new primary
            raise _translate(err) from None

    # ------------------------------------------------------------ embedding tables

    def push_embedding_table_infos(self, infos: list[TableInfo]) -> None:
        """Tell every PS the model's tables (each holds the rows of its ids)."""
        message = elasticdl_pb2.EmbeddingTableInfos(
            tables=[elasticdl_pb2.EmbeddingTableInfo(name=i.name, dim=i.dim, initializer=i.to_json()) for i in infos]
        )
        self._each([functools.partial(stub.push_embedding_table_infos, message) for stub in self._stubs])

    def lookup(self, name: str, ids: np.ndarray, create: bool, snapshot_id: int = 0) -> np.ndarray:
        """Rows of ``ids`` (int64 [n]) in table ``name``, each from the PS holding it, in parallel."""
        ids = np.asarray(ids)
        groups = partition_ids(ids, self.num_ps)
        asked = [(ps, positions) for ps, positions in enumerate(groups) if positions.size]
        replies = self._each([
            functools.partial(self._stubs[ps].pull_embedding_vectors, elasticdl_pb2.PullEmbeddingVectorsRequest(
                name=name, ids=tensor_codec.encode("ids", ids[positions]), create=create, snapshot_id=snapshot_id,
            ))
            for ps, positions in asked
        ])
        if len(asked) == 1 and asked[0][1].size == ids.size:
            return tensor_codec.decode(replies[0])
        out = None
        for (_, positions), reply in zip(asked, replies):
            rows = tensor_codec.decode(reply)
            if out is None:
                out = np.empty((ids.size, rows.shape[1]), np.float32)
            out[positions] = rows
        return out if out is not None else np.zeros((0, 0), np.float32)

    def pull_embedding_table(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows): the whole table gathered from every PS (streamed in chunks)."""
        ids, rows = [], []
        for stub in self._stubs:
            try:
                for chunk in stub.pull_embedding_table(elasticdl_pb2.PullEmbeddingTableRequest(name=name)):
                    ids.append(tensor_codec.decode(chunk.ids))
                    rows.append(tensor_codec.decode(chunk.values))
            except grpc.RpcError as err:
                raise _translate(err) from None
        return np.concatenate(ids), np.concatenate(rows)

    def close(self) -> None:
        for ps in range(self.num_ps):
            self._drop_bulk(ps)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

def _encode_rows(name: str, rows: IndexedRows) -> elasticdl_pb2.IndexedRows:
    return elasticdl_pb2.IndexedRows(
        name=name,
        ids=tensor_codec.encode("ids", np.asarray(rows.ids, np.int64)),
        values=tensor_codec.encode("values", np.asarray(rows.values, np.float32)),
    )


def _translate(err: grpc.RpcError) -> Exception:
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return EmbeddingError(f"the parameter server refused it: {err.details()}")
    return err
