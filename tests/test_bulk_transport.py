"""--tensor_transport tcp: a PS's raw-TCP frames (elasticdl/rpc/bulk.py) carry what its gRPC
streams carry, with the same checks, and refuse callers without the job's token."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from elasticdl.model.embedding.table import EmbeddingError
from elasticdl.proto import elasticdl_pb2
from elasticdl.ps.bulk_server import BulkServer
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import auth, bulk, ps_client
from tests.test_wire_validation import LR, RealPS, assert_same, grads, model, ps_state


@pytest.fixture
def bulk_ps(monkeypatch):
    """A PS with its raw-TCP port; every pull and push of its small model takes it."""
    monkeypatch.setattr(ps_client, "STREAM_ABOVE_BYTES", 0)
    real = RealPS()
    servicer = PServerServicer(real.core)
    real.server.stop(grace=None)  # serve again with this servicer, whose stats name the port
    real.server = ps_client_server(servicer)
    real.address = f"127.0.0.1:{real.server.port}"
    real.bulk = BulkServer(servicer, auth.job_token())
    real.bulk.start()
    yield real
    real.bulk.stop()
    real.close()


def ps_client_server(servicer):
    from elasticdl.rpc import channel

    server = channel.make_server(max_workers=4)
    channel.add_service(server, "PServer", servicer)
    server.port = channel.bind_local(server, 0)
    server.start()
    return server


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_pulls_and_pushes_over_tcp_match_grpc(bulk_ps, wire_dtype):
    over_tcp = ps_client.PSClient([bulk_ps.address], wire_dtype=wire_dtype, tensor_transport="tcp")
    over_grpc = ps_client.PSClient([bulk_ps.address], wire_dtype=wire_dtype)
    try:
        tcp, grpc_ = over_tcp.pull([-1])[0], over_grpc.pull([-1])[0]
        assert over_tcp._bulk[0]  # it went over the socket
        assert (tcp.initialized, tcp.version) == (grpc_.initialized, grpc_.version) == (True, 0)
        for name in model():
            assert tcp.params[name].dtype == np.float32
            np.testing.assert_array_equal(tcp.params[name], grpc_.params[name])
        step = grads(0.5)
        answer = over_tcp.push_gradients({0: step}, [0], None, worker_id=0)[0]
        assert answer.applied and answer.version == 1
        for name, value in model().items():  # SGD, in float32 on the PS (0.5 is exact in bfloat16)
            np.testing.assert_allclose(bulk_ps.core.shard.params[name], value - LR * step[name], rtol=1e-6)
    finally:
        over_tcp.close()
        over_grpc.close()


def test_a_refused_push_over_tcp_is_refused_as_over_grpc(bulk_ps):
    client = ps_client.PSClient([bulk_ps.address], tensor_transport="tcp")
    try:
        before = ps_state(bulk_ps.core)
        bad = grads()
        bad["dense/bias"][0] = np.nan
        answer = client.push_gradients({0: bad}, [0], None, worker_id=0)[0]
        assert not answer.accepted and "NaN or Inf" in answer.reason
        with pytest.raises(EmbeddingError, match="40 bytes, more than the 32"):  # more than the model
            client.push_gradients({0: {**grads(), "nope": np.ones(2, np.float32)}}, [0], None, worker_id=0)
        assert_same(ps_state(bulk_ps.core), before)
        assert client.push_gradients({0: grads()}, [0], None, worker_id=0)[0].applied  # a new connection
    finally:
        client.close()


def test_the_ticket_travels_over_tcp_and_the_ps_checks_it(bulk_ps):
    """A push's ticket (elasticdl/rpc/trust.py) rides in the frame's head, as over gRPC."""
    from elasticdl.rpc import trust
    from elasticdl.rpc.batch_position import BatchPosition

    bulk_ps.core.verifier = trust.TicketVerifier("key")
    issued = trust.mint_ticket("key", trust.TicketFields(task_id=5, handout=2, worker_id=0, start=0, end=64))
    client = ps_client.PSClient([bulk_ps.address], tensor_transport="tcp")
    try:
        before = ps_state(bulk_ps.core)
        forged = client.push_gradients({0: grads()}, [0], 0.0, worker_id=0, batch=BatchPosition(5, 2, 64, 64, b"x"))[0]
        assert not forged.accepted and "does not verify" in forged.reason
        assert client._bulk[0]  # it went over the socket
        assert_same(ps_state(bulk_ps.core), before)
        own = client.push_gradients({0: grads()}, [0], 0.0, worker_id=0, batch=BatchPosition(5, 2, 32, 32, issued))[0]
        assert own.applied and bulk_ps.core.position.marks == {5: 32}
    finally:
        client.close()


def _connect(bulk_ps, token: bytes | None) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", bulk_ps.bulk.port), timeout=10)
    if token is not None:
        bulk.send_frame(conn, bulk.AUTH, token)
    return conn


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("token", [b"wrong", b"", None])
def test_a_caller_without_the_jobs_token_gets_nothing(bulk_ps, token):
    with _connect(bulk_ps, token) as conn:  # None: a pull first, without an AUTH frame
        bulk.send_frame(conn, bulk.PULL, elasticdl_pb2.PullDenseParametersRequest(version=-1).SerializeToString())
        assert _closed(conn)


def _refused_push(bulk_ps, head: elasticdl_pb2.PushGradientsRequest, payload: bytes, closes: bool) -> str:
    before = ps_state(bulk_ps.core)
    with _connect(bulk_ps, auth.job_token().encode()) as conn:
        bulk.send_frame(conn, bulk.PUSH, head.SerializeToString())
        conn.sendall(payload)
        kind, answer = bulk.recv_head(conn)
        assert kind == bulk.ERROR
        if closes:  # the bytes it announced are unknown or more than any push: not read
            assert _closed(conn)
        else:  # read and dropped: the connection serves the next request
            bulk.send_frame(conn, bulk.PULL, elasticdl_pb2.PullDenseParametersRequest(version=0).SerializeToString())
            assert bulk.recv_head(conn)[0] == bulk.REPLY
    assert_same(ps_state(bulk_ps.core), before)
    return answer.decode()


def test_hostile_pushes_over_tcp_are_invalid_argument_and_change_nothing(bulk_ps):
    def meta(name, dtype, shape):
        return elasticdl_pb2.Tensor(name=name, dtype=dtype, shape=shape)

    bias = meta("dense/bias", "float32", [2])
    cases = [  # (head, bytes sent after it, the connection closes, the answer says)
        (elasticdl_pb2.PushGradientsRequest(wire_dtype="int8", gradients=[bias]), bytes(8), False, "'int8'"),
        (elasticdl_pb2.PushGradientsRequest(gradients=[meta("dense/kernel", "float32", [3, 3])]), bytes(36), False,
         "36 bytes, more than the 32"),
        # Refused before any byte is read or allocated:
        (elasticdl_pb2.PushGradientsRequest(gradients=[meta("dense/kernel", "float32", [2**40, 2**20])]), b"", True,
         "more than the"),
        (elasticdl_pb2.PushGradientsRequest(gradients=[meta("dense/kernel", "int8", [3, 2])]), b"", True,
         "unsupported dtype"),
        (elasticdl_pb2.PushGradientsRequest(gradients=[bias, bias]), b"", True, "appears twice"),
    ]
    for head, payload, closes, text in cases:
        answer = _refused_push(bulk_ps, head, payload, closes)
        assert answer.startswith("INVALID_ARGUMENT:") and text in answer, answer
    # bfloat16 bytes for a float32 variable of another shape: read, then refused by the PS's check.
    head = elasticdl_pb2.PushGradientsRequest(gradients=[meta("dense/bias", "bfloat16", [3])])
    with _connect(bulk_ps, auth.job_token().encode()) as conn:
        bulk.send_frame(conn, bulk.PUSH, head.SerializeToString())
        conn.sendall(bytes(6))
        kind, answer = bulk.recv_head(conn)
    reply = elasticdl_pb2.PushGradientsResponse.FromString(answer)
    assert kind == bulk.REPLY and reply.outcome == elasticdl_pb2.REJECTED_INVALID and "shape" in reply.reason


@pytest.mark.parametrize("frame", [b"XXXX" + bytes(5), bulk.HEADER.pack(bulk.MAGIC, 9, 0),
                                   bulk.HEADER.pack(bulk.MAGIC, bulk.PUSH, bulk.MAX_HEAD_BYTES + 1)])
def test_bytes_that_are_not_a_frame_close_the_connection(bulk_ps, frame):
    before = ps_state(bulk_ps.core)
    with _connect(bulk_ps, auth.job_token().encode()) as conn:
        conn.sendall(frame)
        assert _closed(conn)
    assert_same(ps_state(bulk_ps.core), before)


def test_a_ps_without_the_transport_is_reached_over_grpc(monkeypatch):
    monkeypatch.setattr(ps_client, "STREAM_ABOVE_BYTES", 0)
    real = RealPS()
    client = ps_client.PSClient([real.address], tensor_transport="tcp")
    try:
        assert client.pull([-1])[0].version == 0
        assert client.push_gradients({0: grads()}, [0], None, worker_id=0)[0].applied
        assert client._bulk[0] is False
    finally:
        client.close()
        real.close()


def test_a_push_or_pull_that_cannot_reach_the_port_goes_over_grpc(bulk_ps):
    port = bulk_ps.bulk.port
    bulk_ps.bulk.stop()
    bulk_ps.bulk._servicer.bulk_port = port  # the stats still name the port: nothing listens there
    client = ps_client.PSClient([bulk_ps.address], tensor_transport="tcp")
    try:
        assert client.push_gradients({0: grads()}, [0], None, worker_id=0)[0].applied
        assert client.pull([-1])[0].version == 1
        assert client._bulk[0] is None  # it tries again at the next call
    finally:
        client.close()


def test_a_push_whose_answer_is_lost_is_sent_again_over_grpc_and_applied_once(bulk_ps, monkeypatch):
    """The connection breaks after the PS applied a push, before its answer arrives: sent again
    over gRPC with the same task place, the PS answers it as applied and does not apply it
    again. Without a task place it is not sent again: a second send could apply it twice."""
    from elasticdl.rpc.batch_position import BatchPosition

    client = ps_client.PSClient([bulk_ps.address], tensor_transport="tcp")
    real_recv_head = bulk.recv_head
    lost = []

    def answer_lost_once(conn):
        answer = real_recv_head(conn)  # the PS has applied the push and answered
        if conn is client._bulk[0] and not lost:  # the client's read (the PS reads frames with it too)
            lost.append(answer)
            raise ConnectionResetError("the connection broke")
        return answer

    monkeypatch.setattr(bulk, "recv_head", answer_lost_once)
    try:
        step = grads(0.5)
        batch = BatchPosition(task_id=7, handout=1, records_end=32, records=32)
        answer = client.push_gradients({0: step}, [0], None, worker_id=0, batch=batch)[0]
        assert lost and answer.applied and answer.version == 1  # "already applied", not applied again
        assert bulk_ps.core.shard.version == 1
        for name, value in model().items():
            np.testing.assert_allclose(bulk_ps.core.shard.params[name], value - LR * step[name], rtol=1e-6)
        lost.clear()
        with pytest.raises(bulk.PushMaybeApplied, match="broke once sent"):
            client.push_gradients({0: step}, [1], None, worker_id=0)
        assert bulk_ps.core.shard.version == 2  # applied by the one send, and not sent again
    finally:
        client.close()


def test_the_socket_is_the_ps_own_address_not_the_one_its_grpc_is_reached_at(monkeypatch):
    """On Kubernetes a PS is reached over gRPC at its Service, which carries only the gRPC port:
    the raw-TCP port is on the PS's own address (its pod's IP), which its stats name. Here the
    PS listens on 127.0.0.2 while its gRPC address is 127.0.0.1."""
    monkeypatch.setattr(ps_client, "STREAM_ABOVE_BYTES", 0)
    real = RealPS()
    servicer = PServerServicer(real.core)
    real.server.stop(grace=None)
    real.server = ps_client_server(servicer)
    real.address = f"127.0.0.1:{real.server.port}"
    real.bulk = BulkServer(servicer, auth.job_token(), host="127.0.0.2")
    real.bulk.start()
    client = ps_client.PSClient([real.address], tensor_transport="tcp")
    try:
        assert client.pull([-1])[0].version == 0
        assert client._bulk[0] and client._bulk[0].getpeername()[0] == "127.0.0.2"  # over the socket
        assert client.push_gradients({0: grads()}, [0], None, worker_id=0)[0].applied
    finally:
        client.close()
        real.bulk.stop()
        real.close()


def test_a_port_that_cannot_be_reached_is_not_tried_at_every_call(bulk_ps, monkeypatch):
    """A failed connect costs one call its timeout; the calls after it go over gRPC without
    trying for BULK_RETRY_SECONDS, then the socket is tried again."""
    import time

    port = bulk_ps.bulk.port
    bulk_ps.bulk.stop()
    bulk_ps.bulk._servicer.bulk_port = port  # the stats still name the port: nothing listens there
    tries = []
    real_connect = socket.create_connection

    def counted(address, timeout=None):
        tries.append(address)
        return real_connect(address, timeout=timeout)

    monkeypatch.setattr(socket, "create_connection", counted)
    client = ps_client.PSClient([bulk_ps.address], tensor_transport="tcp")
    try:
        for _ in range(3):
            assert client.push_gradients({0: grads()}, [client.pull([-1])[0].version], None, worker_id=0)[0].applied
        assert len(tries) == 1
        client._bulk_retry_at[0] = time.monotonic()  # the retry time came
        client.pull([-1])
        assert len(tries) == 2
    finally:
        client.close()
