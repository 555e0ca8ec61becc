"""Per-job token auth: in a cluster every gRPC call must carry the job's token.

Servers and channels come from elasticdl.rpc.channel, as in the roles; the token comes
from the file $ELASTICDL_TOKEN_FILE names (the mounted Secret in a pod).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.proto import elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import auth as security
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc.ps_client import PSClient

PARAMS = {"dense/kernel": np.ones((3, 2), np.float32), "dense/bias": np.zeros((2,), np.float32)}
GRADS = {"dense/kernel": np.full((3, 2), 0.5, np.float32), "dense/bias": np.ones((2,), np.float32)}


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text(security.new_token() + "\n")
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(path))
    return path


@pytest.fixture
def ps_server(token_file):
    """A real PS behind a server made while the job token is mounted."""
    core = ParameterServer(PSSettings(), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})))
    server = grpc_utils.make_server()
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server)
    server.start()
    yield core, f"127.0.0.1:{port}"
    server.stop(0)


def test_no_token_outside_a_cluster(monkeypatch):
    monkeypatch.delenv(security.TOKEN_FILE_ENV, raising=False)
    assert security.job_token() is None
    assert security.server_interceptors() == []


def test_calls_with_the_token_pass(ps_server):
    core, address = ps_server
    client = PSClient([address])  # make_channel adds the token
    assert client.push_model(PARAMS) == [True]
    client.push_gradients({0: GRADS}, [0], 0.1, worker_id=0)
    assert core.shard.version == 1
    client.close()


def test_a_call_without_the_token_is_refused_and_changes_nothing(ps_server, monkeypatch):
    core, address = ps_server
    PSClient([address]).push_model(PARAMS)
    before = {k: v.copy() for k, v in core.shard.params.items()}

    monkeypatch.delenv(security.TOKEN_FILE_ENV)  # a client that does not have the Secret
    intruder = PSClient([address])
    with pytest.raises(grpc.RpcError) as err:
        intruder.push_gradients({0: GRADS}, [0], 0.1, worker_id=0)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        intruder.push_model({k: v + 1 for k, v in PARAMS.items()}, version=7)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        intruder.pull([-1])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    intruder.close()

    assert core.shard.version == 0
    for name, value in before.items():
        np.testing.assert_array_equal(core.shard.params[name], value)


def test_a_wrong_token_is_refused(ps_server, tmp_path, monkeypatch):
    core, address = ps_server
    wrong = tmp_path / "wrong"
    wrong.write_text(security.new_token())
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(wrong))
    with pytest.raises(grpc.RpcError) as err:
        PSClient([address]).push_model(PARAMS)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not core.shard.params


def test_the_master_refuses_calls_without_the_token(token_file, monkeypatch):
    from elasticdl.proto import elasticdl_pb2

    class Master(elasticdl_pb2_grpc.MasterServicer):
        calls = 0

        def get_task(self, request, context):
            Master.calls += 1
            return elasticdl_pb2.Task(type=elasticdl_pb2.WAIT)

    server = grpc_utils.make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(Master(), server)
    port = grpc_utils.bind_local(server)
    server.start()
    try:
        with grpc_utils.make_channel(f"127.0.0.1:{port}") as channel:
            elasticdl_pb2_grpc.MasterStub(channel).get_task(elasticdl_pb2.GetTaskRequest(worker_id=0))
        assert Master.calls == 1
        monkeypatch.delenv(security.TOKEN_FILE_ENV)
        with grpc_utils.make_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                elasticdl_pb2_grpc.MasterStub(channel).get_task(elasticdl_pb2.GetTaskRequest(worker_id=0))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert Master.calls == 1  # the servicer never ran
    finally:
        server.stop(0)


def test_an_unreadable_token_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="Secret is not mounted"):
        security.job_token()
