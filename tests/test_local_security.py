"""Local mode fails closed too, with real processes over real gRPC: every role requires the
job's token, which the master makes and hands to its children in a 0600 file (never on a
command line), and `elasticdl scale` reads beside master.addr.

The Kubernetes side of the token: tests/test_k8s_security.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import grpc
import numpy as np
import pytest

from elasticdl.config import JobConfig
from elasticdl.launch.local import LocalBackend
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.rpc import auth
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc.ps_client import PSClient

PARAMS = {"dense/kernel": np.ones((3, 2), np.float32)}


@pytest.fixture
def role_files(tmp_path):
    config = JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="d", job_name="sec")
    config_file, optimizer_file = tmp_path / "job_config.json", tmp_path / "optimizer.json"
    config_file.write_text(config.to_json())
    optimizer_file.write_text(json.dumps({"name": "SGD", "config": {"learning_rate": 0.1}}))
    return ["--job_config", str(config_file), "--optimizer_spec", str(optimizer_file), "--ps_id", "0"]


def _env_without_token(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != auth.TOKEN_FILE_ENV}
    return {**env, **extra}


@pytest.mark.parametrize("extra", [
    {},
    {grpc_utils.POD_IP_ENV: "127.0.0.1"},  # the tester's case: it used to serve anyone on that address
], ids=["local", "with a pod IP"])
def test_a_ps_started_without_a_token_exits_with_a_clear_error(role_files, tmp_path, extra):
    ready = tmp_path / "ready"
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl.ps.main", *role_files, "--ready_file", str(ready)],
        env=_env_without_token(**extra), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "elasticdl ps-0: job failed: parameter server 0 refuses to start without the job's token: "
        "$ELASTICDL_TOKEN_FILE is not set. The master hands the token to the PS and workers it starts "
        "(on Kubernetes, through the job's Secret); to start one by hand, set $ELASTICDL_TOKEN_FILE to "
        "a 0600 file holding the job's token"
    ]
    assert not ready.exists()  # it never served


def test_a_worker_started_without_a_token_exits_with_a_clear_error(role_files):
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl.worker.main", "--job_config", role_files[1], "--worker_id", "3",
         "--master_addr", "127.0.0.1:1", "--ps_addrs", "127.0.0.1:2"],
        env=_env_without_token(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "elasticdl worker-3: job failed: worker 3 refuses to start without the job's token" in result.stderr


def test_a_ps_with_a_world_readable_token_file_refuses_to_start(role_files, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(auth.new_token())
    token_file.chmod(0o644)
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl.ps.main", *role_files],
        env=_env_without_token(**{auth.TOKEN_FILE_ENV: str(token_file)}), capture_output=True, text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "is readable by every user (mode 0644)" in result.stderr


@pytest.fixture
def backend(tmp_path, monkeypatch):
    """A LocalBackend of a job with no token in the environment: it makes its own."""
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    b = LocalBackend(str(tmp_path / "logs"))
    yield b
    b.stop_all(5)


def test_the_local_backend_hands_its_ps_a_fresh_token_and_strangers_are_refused(backend, role_files):
    backend.start("ps", 0, role_files)
    [address] = backend.ps_addresses(1, 60)
    assert address.startswith("127.0.0.1:")
    token = backend.token()

    # The token is nowhere on the PS's command line, which every local user can read ...
    with open(f"/proc/{backend.pid('ps', 0)}/cmdline", "rb") as f:
        assert token.encode() not in f.read()
    # ... but in a file only this user may read, in a directory only this user may enter.
    with open(f"/proc/{backend.pid('ps', 0)}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    token_file = env[auth.TOKEN_FILE_ENV.encode()].decode()
    assert open(token_file).read().strip() == token
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(token_file)).st_mode) == 0o700

    client = PSClient([address], token=token)
    assert client.push_model(PARAMS) == [True]

    # A local user without the token: no metadata at all, then a wrong token.
    for channel in (grpc.insecure_channel(address), grpc_utils.make_channel(address, auth.new_token())):
        with channel:
            stub = grpc_utils.ServiceStub(channel, "PServer")
            with pytest.raises(grpc.RpcError) as err:
                stub.push_model(elasticdl_pb2.Model(version=99), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "missing or wrong job token" in err.value.details()
    [pulled] = client.pull([-1])
    assert pulled.version == 0  # the refused push changed nothing
    np.testing.assert_array_equal(pulled.params["dense/kernel"], PARAMS["dense/kernel"])
    client.close()


def test_starting_a_ps_index_that_still_runs_stops_the_old_process_first(backend, role_files):
    """One index, one process: a second PS on the same port would share it (gRPC binds with
    SO_REUSEPORT), each with its own state, and the workers' calls would land on either."""
    backend.start("ps", 0, role_files)
    [address] = backend.ps_addresses(1, 60)
    first = backend._children[("ps", 0)].popen
    backend.start("ps", 0, [*role_files, "--port", address.rsplit(":", 1)[1]])
    assert first.poll() is not None  # stopped before the new one started
    assert backend.pid("ps", 0) != first.pid and backend.running("ps") == [0]


def test_an_inherited_token_file_is_the_jobs_token(tmp_path, monkeypatch):
    path = auth.write_private(str(tmp_path / "t"), "inherited\n")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, path)
    assert LocalBackend(str(tmp_path / "logs")).token() == "inherited"
    monkeypatch.delenv(auth.TOKEN_FILE_ENV)
    a, b = LocalBackend(str(tmp_path / "a")), LocalBackend(str(tmp_path / "b"))
    assert a.token() != b.token() and len(a.token()) >= 40  # one per job, 256 random bits


# ---------------------------------------------------------------- elasticdl scale


class _Master(elasticdl_pb2_grpc.MasterServicer):
    def __init__(self):
        self.requests = []

    def scale(self, request, context):
        self.requests.append(request.num_workers)
        return elasticdl_pb2.ScaleResponse(accepted=True, message=f"scaling to {request.num_workers} workers")


@pytest.fixture
def running_job(tmp_path, monkeypatch):
    """A master serving with its job's token, with runs/<job>/master.addr and runs/<job>/token
    as Job._start writes them; the caller's environment has no token."""
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    token = auth.new_token()
    master = _Master()
    server = grpc_utils.make_server(token=token)
    elasticdl_pb2_grpc.add_MasterServicer_to_server(master, server)
    port = grpc_utils.bind_local(server)
    server.start()
    run_dir = tmp_path / "runs" / "j"
    run_dir.mkdir(parents=True)
    (run_dir / "master.addr").write_text(f"127.0.0.1:{port}")
    auth.write_private(str(run_dir / "token"), token + "\n")
    yield master, run_dir
    server.stop(0)


def test_scale_reads_the_token_beside_master_addr(running_job):
    from elasticdl.api import scale

    master, _ = running_job
    assert scale("j", 3) == "scaling to 3 workers"
    assert master.requests == [3]


def test_scale_without_the_token_file_is_a_clear_error_and_sends_nothing(running_job, capsys):
    from elasticdl import cli

    master, run_dir = running_job
    os.remove(run_dir / "token")
    assert cli.main(["scale", "--job_name", "j", "--num_workers", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elasticdl scale: error: no token for job 'j': runs/j/token does not exist")
    assert err.count("\n") == 1 and master.requests == []


def test_scale_with_another_jobs_token_is_refused_by_the_master(running_job):
    from elasticdl.api import ScaleTokenError, scale

    master, run_dir = running_job
    auth.write_private(str(run_dir / "token"), auth.new_token())  # e.g. the job restarted since
    with pytest.raises(ScaleTokenError, match="refused our token for job 'j'"):
        scale("j", 3)
    assert master.requests == []


def test_scale_refuses_a_world_readable_token_file(running_job):
    from elasticdl.api import ScaleTokenError, scale

    master, run_dir = running_job
    os.chmod(run_dir / "token", 0o644)
    with pytest.raises(ScaleTokenError, match="readable by every user"):
        scale("j", 3)
    assert master.requests == []


def test_a_local_user_without_the_token_cannot_drive_the_master(running_job):
    master, run_dir = running_job
    address = (run_dir / "master.addr").read_text()
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            elasticdl_pb2_grpc.MasterStub(channel).scale(elasticdl_pb2.ScaleRequest(num_workers=0), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and master.requests == []


# ---------------------------------------------------------------- a whole job


def test_a_job_without_any_token_in_its_environment_makes_one_and_runs(tmp_path):
    """The master makes the token, its PS and worker get it, and runs/<job>/token is 0600."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    zoo = os.path.join(repo, "model_zoo")
    data = tmp_path / "digits"
    subprocess.run([sys.executable, os.path.join(zoo, "digits", "prepare_data.py"), "--output", str(data)],
                   check=True, capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", zoo,
         "--model_def", "digits.digits_functional.custom_model", "--training_data", str(data / "train"),
         "--minibatch_size", "64", "--num_epochs", "1", "--num_workers", "1", "--num_ps", "1",
         "--job_name", "tokenjob"],
        cwd=tmp_path, env=_env_without_token(), capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout[result.stdout.index("{"):])["records_trained"] == 1437
    token_file = tmp_path / "runs" / "tokenjob" / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token_file.read_text().strip()) >= 40
