"""The PS trusts only what the master handed out (elasticdl/rpc/trust.py).

Every role holds the job's token, so the token alone let any caller forge the evidence behind
``exactly_once``: a push naming an invented task, hand-out or ``records_end`` was taken, and
the real pushes of that task were then dropped as "already taken"; ``get_task`` handed real
tasks to phantom worker ids. Now:

- a push that names a task must carry the ticket the master signed for that task, hand-out,
  worker and record range; anything else is REJECTED_INVALID and changes nothing;
- the master's calls that name a worker id need that worker's credential (PERMISSION_DENIED).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import stat

import grpc
import numpy as np
import pytest

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc import trust
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.push_outcome import PushOutcome

KEY = "the-job-key-only-the-master-and-the-ps-hold"
PARAMS = {"dense/kernel": np.ones((3, 2), np.float32), "dense/bias": np.zeros((2,), np.float32)}
GRADS = {"dense/kernel": np.full((3, 2), 0.5, np.float32), "dense/bias": np.ones((2,), np.float32)}
# Task 7 (records [100, 164) of its file), hand-out 3, given to worker 1.
ISSUED = trust.TicketFields(task_id=7, handout=3, worker_id=1, start=100, end=164)


def make_ps() -> ParameterServer:
    ps = ParameterServer(PSSettings(), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})),
                         verifier=trust.TicketVerifier(KEY))
    assert ps.push_model({k: v.copy() for k, v in PARAMS.items()}) == (True, 0)
    return ps


def snapshot(ps: ParameterServer):
    """Everything a push may change: the shard and its data position."""
    return copy.deepcopy((ps.shard.params, ps.shard.version, ps.position.marks, ps.position.records_applied,
                          ps.position.accepted_mark(ISSUED.task_id)))


def assert_unchanged(ps: ParameterServer, before) -> None:
    after = snapshot(ps)
    for name, value in before[0].items():
        np.testing.assert_array_equal(after[0][name], value)
    assert after[1:] == before[1:]


def ticket(**changes) -> bytes:
    return trust.mint_ticket(KEY, dataclasses.replace(ISSUED, **changes))


def push(ps, batch: BatchPosition, worker_id: int = 1):
    return ps.push_gradients(GRADS, ps.shard.version, None, batch=batch, worker_id=worker_id)


# ---------------------------------------------------------------- the PS core


def test_a_push_under_its_ticket_is_applied():
    ps = make_ps()
    result = push(ps, BatchPosition(7, 3, 132, 32, ticket()))
    assert result.outcome is PushOutcome.APPLIED and ps.shard.version == 1
    assert ps.position.marks == {7: 132} and ps.position.records_applied == 32


@pytest.mark.parametrize("batch, worker_id, words", [
    # A task id the master never issued (the ticket is task 7's).
    (BatchPosition(8, 3, 132, 32, ticket()), 1, "names task 8, hand-out 3, worker 1; its ticket is for task 7"),
    # Another hand-out of the task (e.g. one the master fenced, or one it never made).
    (BatchPosition(7, 4, 132, 32, ticket()), 1, "hand-out 4"),
    # records_end beyond the task's records, or at its very start.
    (BatchPosition(7, 3, 10_000, 32, ticket()), 1, r"records_end 10000 is outside its ticket's records \[100, 164\)"),
    (BatchPosition(7, 3, 100, 0, ticket()), 1, "records_end 100 is outside"),
    # More records than lie between the task's start and records_end.
    (BatchPosition(7, 3, 132, 64, ticket()), 1, "counts 64 records ending before 132; task 7 starts at 100"),
    # Another worker's ticket: worker 2 pushes what the master handed to worker 1.
    (BatchPosition(7, 3, 132, 32, ticket()), 2, "worker 2; its ticket is for task 7, hand-out 3, worker 1"),
    # A ticket signed with any other key (a token holder's own), or altered after signing.
    (BatchPosition(7, 3, 132, 32, trust.mint_ticket("a-guess", ISSUED)), 1, "does not verify"),
    (BatchPosition(7, 3, 132, 32, ticket(end=10_000)[:-1] + b"x"), 1, "does not verify"),
    (BatchPosition(7, 3, 132, 32, b"\0" * 72), 1, "does not verify"),
    # No ticket at all.
    (BatchPosition(7, 3, 132, 32), 1, "without a ticket"),
])
def test_a_push_its_ticket_does_not_cover_is_refused_and_changes_nothing(batch, worker_id, words):
    ps = make_ps()
    before = snapshot(ps)
    result = push(ps, batch, worker_id)
    assert result.outcome is PushOutcome.REJECTED_INVALID
    assert re.search(words, result.reason), result.reason
    assert_unchanged(ps, before)
    assert ps.strategy.telemetry.pushes_rejected_invalid == 1


def test_a_forged_push_no_longer_makes_the_real_pushes_of_its_task_already_taken():
    """The attack: a token holder pushes task 7 to its very end first; the real worker's pushes
    were then answered 'already applied' and never applied: records lost, exactly_once 'held'."""
    ps = make_ps()
    forged = push(ps, BatchPosition(7, 3, 164, 64, trust.mint_ticket("forger", ISSUED)), worker_id=1)
    assert forged.outcome is PushOutcome.REJECTED_INVALID
    real = push(ps, BatchPosition(7, 3, 132, 32, ticket()))
    assert real.outcome is PushOutcome.APPLIED and real.reason != "already applied"
    assert ps.position.marks == {7: 132} and ps.position.records_applied == 32


def test_accumulated_pushes_keep_their_ticket():
    """--push_steps: the accumulated push names the last batch's end and every batch's records."""
    from elasticdl.worker.accumulation import GradientAccumulator

    acc = GradientAccumulator()
    acc.add({k: v.copy() for k, v in GRADS.items()}, BatchPosition(7, 3, 132, 32, ticket()))
    acc.add({k: v.copy() for k, v in GRADS.items()}, BatchPosition(7, 3, 164, 32, ticket()))
    _, position = acc.means()
    assert position == BatchPosition(7, 3, 164, 64, ticket())
    assert push(make_ps(), position).outcome is PushOutcome.APPLIED


@pytest.fixture
def served_ps(tmp_path):
    """A sync PS (grads_to_wait 2) holding the job key, behind a real gRPC server: (core, address)."""
    from elasticdl.ps.servicer import PServerServicer
    from elasticdl.rpc import auth
    from elasticdl.rpc import channel as grpc_utils

    auth.ensure_process_token(str(tmp_path))
    ps = ParameterServer(PSSettings(grads_to_wait=2), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})),
                         verifier=trust.TicketVerifier(KEY))
    server = grpc_utils.make_server()
    grpc_utils.add_service(server, "PServer", PServerServicer(ps))
    port = grpc_utils.bind_local(server)
    server.start()
    yield ps, f"127.0.0.1:{port}"
    server.stop(None)


def test_the_ticket_travels_over_grpc_and_the_ps_checks_it(served_ps):
    from elasticdl.rpc.ps_client import PSClient

    ps, address = served_ps
    client = PSClient([address])
    try:
        assert client.push_model(PARAMS) == [True]
        forged = client.push_gradients({0: GRADS}, [0], 0.0, 1, batch=BatchPosition(7, 3, 164, 64, b"forged"))
        assert forged[0].outcome is PushOutcome.REJECTED_INVALID and "does not verify" in forged[0].reason
        real = client.push_gradients({0: GRADS}, [0], 0.0, 1, batch=BatchPosition(7, 3, 132, 32, ticket()))
        assert real[0].outcome is PushOutcome.ACCEPTED_PENDING and ps.position.accepted_mark(7) == 132
    finally:
        client.close()


def test_only_the_master_may_fence_roll_back_or_steer_a_ps(served_ps, tmp_path):
    """A token holder without the master's credential cannot fence another worker's hand-out,
    set the learning rate, the live workers, snapshots, checkpoints or a leveling: PERMISSION_DENIED."""
    from elasticdl.rpc.ps_client import PSClient

    ps, address = served_ps
    intruder = PSClient([address])
    master = PSClient([address], master_credential=trust.master_credential(KEY))
    try:
        assert intruder.push_model(PARAMS) == [True]  # the first worker's model: not a master command
        commands = [lambda: intruder.fence([3], [7]), lambda: intruder.set_learning_rate(100.0),
                    lambda: intruder.set_live_workers(0), lambda: intruder.take_snapshot(1),
                    lambda: intruder.drop_snapshot(1), lambda: intruder.save_checkpoint(),
                    lambda: intruder.restore(str(tmp_path / "version-1"), 0), lambda: intruder.level_versions()]
        for command in commands:
            with pytest.raises(grpc.RpcError) as err:
                command()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "master's credential" in err.value.details()
        assert ps.position.fenced == set() and ps._learning_rate is None and ps.strategy.grads_to_wait == 2
        assert not ps._snapshots
        assert master.fence([3], [7]) == [{7: 0}] and ps.position.fenced == {3}  # the master's is taken
        master.set_live_workers(1)
        assert ps.strategy.grads_to_wait == 1
    finally:
        intruder.close()
        master.close()


# ---------------------------------------------------------------- the master


@pytest.fixture
def master(tmp_path):
    """A master serving one training task (records [0, 10) of 'f'), with the job key."""
    from master_loop import master_servicer

    from elasticdl.data.sources import Shard
    from elasticdl.master.clocks import WorkerClocks
    from elasticdl.master.evaluation_service import TaskDispatcher
    from elasticdl.master.progress import TrainingProgress
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc import auth
    from elasticdl.rpc.channel import bind_local, make_server

    auth.ensure_process_token(str(tmp_path))
    dispatcher = TaskDispatcher(TaskManager([Shard("f", 0, 10)], shuffle=False), None)
    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        master_servicer(dispatcher, TrainingProgress(10, 1), WorkerClocks(), job_key=KEY), server)
    port = bind_local(server)
    server.start()
    yield f"127.0.0.1:{port}", dispatcher
    server.stop(None)


def client_for(address: str, worker_id: int, credential: str | None):
    from elasticdl.rpc.master_client import MasterClient

    return MasterClient(address, worker_id, credential="" if credential is None else credential)


def test_a_phantom_worker_id_gets_no_task(master):
    address, dispatcher = master
    phantom = client_for(address, 10**6, None)
    with pytest.raises(grpc.RpcError) as err:
        phantom.get_task()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "without the worker's credential" in err.value.details()
    phantom.close()
    # The task is still there for a worker the master launched.
    real = client_for(address, 0, trust.worker_credential(KEY, 0))
    order = real.get_task()
    assert order.kind == "training" and (order.start, order.end) == (0, 10)
    real.close()


def test_a_worker_cannot_act_as_another(master):
    address, _ = master
    worker_1 = trust.worker_credential(KEY, 1)
    owner = client_for(address, 0, trust.worker_credential(KEY, 0))
    order = owner.get_task()
    impostor = client_for(address, 0, worker_1)  # worker 1's credential, naming worker 0
    for call in (impostor.get_task, lambda: impostor.report(order.task_id, 10, handout=order.handout)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is not worker 0's" in err.value.details()
    # Its own id, with a made-up credential, fares no better.
    guesser = client_for(address, 5, "00" * 32)
    with pytest.raises(grpc.RpcError) as err:
        guesser.get_task()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert owner.report(order.task_id, 10, handout=order.handout)  # the owner's report is taken
    for c in (owner, impostor, guesser):
        c.close()


def test_a_training_task_comes_with_a_ticket_the_ps_verifies(master):
    address, _ = master
    worker = client_for(address, 4, trust.worker_credential(KEY, 4))
    order = worker.get_task()
    worker.close()
    verifier = trust.TicketVerifier(KEY)
    assert verifier.read(order.ticket) == trust.TicketFields(order.task_id, order.handout, 4, 0, 10)
    assert verifier.problem(order.ticket, order.task_id, order.handout, 4, 10, 10) == ""


# ---------------------------------------------------------------- who gets what (local backend)


def test_the_local_backend_gives_the_key_to_the_ps_and_each_worker_only_its_credential(tmp_path, monkeypatch):
    from elasticdl.launch import local

    spawned = []

    class Popen:
        def __init__(self, argv, env, **kwargs):
            spawned.append(env)
            self.pid = 1

    monkeypatch.setattr(local.subprocess, "Popen", Popen)
    monkeypatch.setenv(trust.JOB_KEY_FILE_ENV, "/the/masters/own/key")  # e.g. the master pod's mount
    monkeypatch.setattr(trust, "job_key", lambda: KEY)
    backend = local.LocalBackend(str(tmp_path / "logs"), spares=0)
    backend._spawn(["elasticdl.ps.main"], backend._role_env("ps", 0))
    backend._spawn(["elasticdl.worker.main"], backend._role_env("worker", 2))
    ps_env, worker_env = spawned
    key_file = ps_env[trust.JOB_KEY_FILE_ENV]
    assert key_file != "/the/masters/own/key" and open(key_file).read().strip() == KEY
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert trust.WORKER_CREDENTIAL_ENV not in ps_env
    assert trust.JOB_KEY_FILE_ENV not in worker_env  # not even the master's own
    assert worker_env[trust.WORKER_CREDENTIAL_ENV] == trust.worker_credential(KEY, 2)
    assert KEY not in "".join(worker_env.values())


# ---------------------------------------------------------------- a real PS process


def test_a_real_ps_process_refuses_forged_pushes_and_a_1e38_gradient(tmp_path, monkeypatch):
    """The PS process the local backend starts holds the job key (and no worker does): a forged
    ticket and a 1e38 gradient both leave its model as it was, and its stats count the refusal."""
    import json

    from elasticdl.config import JobConfig
    from elasticdl.launch.local import LocalBackend
    from elasticdl.rpc import auth
    from elasticdl.rpc.ps_client import PSClient

    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    monkeypatch.delenv(trust.JOB_KEY_FILE_ENV, raising=False)
    backend = LocalBackend(str(tmp_path / "logs"), spares=0)
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, backend._child_token_file())  # this test is the master
    config, optimizer = tmp_path / "job_config.json", tmp_path / "optimizer.json"
    config.write_text(JobConfig.from_flags(job_name="trust", log_level="WARNING").to_json())
    optimizer.write_text(json.dumps({"name": "Adam", "config": {"learning_rate": 0.01}}))
    backend.start("ps", 0, ["--job_config", str(config), "--optimizer_spec", str(optimizer), "--ps_id", "0"])
    try:
        [address] = backend.ps_addresses(1, 120)
        client = PSClient([address])
        assert client.push_model(PARAMS) == [True]
        key = backend.job_key()
        own = trust.mint_ticket(key, ISSUED)
        forged = client.push_gradients({0: GRADS}, [0], 0.0, 1, batch=BatchPosition(7, 3, 164, 64, ticket()))
        assert forged[0].outcome is PushOutcome.REJECTED_INVALID and "does not verify" in forged[0].reason
        huge = {name: np.full_like(value, 1e38) for name, value in GRADS.items()}
        refused = client.push_gradients({0: huge}, [0], 0.0, 1, batch=BatchPosition(7, 3, 132, 32, own))
        assert refused[0].outcome is PushOutcome.REJECTED_INVALID and "float32" in refused[0].reason
        pulled = client.pull([-1])[0]
        assert pulled.version == 0
        for name, value in PARAMS.items():
            np.testing.assert_array_equal(pulled.params[name], value)
        [stats] = client.stats()
        assert stats.gradients_refused == 1 and stats.pushes_rejected_invalid == 2
        applied = client.push_gradients({0: GRADS}, [0], 0.0, 1, batch=BatchPosition(7, 3, 132, 32, own))
        assert applied[0].outcome is PushOutcome.APPLIED
        client.close()
    finally:
        backend.stop_all(5)


def test_a_ps_started_with_the_token_but_without_the_job_key_exits_with_a_clear_error(tmp_path):
    import subprocess
    import sys

    from elasticdl.config import JobConfig
    from elasticdl.rpc import auth

    config, optimizer = tmp_path / "job_config.json", tmp_path / "optimizer.json"
    config.write_text(JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="d").to_json())
    optimizer.write_text('{"name": "SGD", "config": {"learning_rate": 0.1}}')
    token = tmp_path / "token"
    auth.write_private(str(token), "t\n")
    env = {k: v for k, v in os.environ.items() if k != trust.JOB_KEY_FILE_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl.ps.main", "--job_config", str(config), "--optimizer_spec", str(optimizer),
         "--ps_id", "0", "--ready_file", str(tmp_path / "ready")],
        env={**env, auth.TOKEN_FILE_ENV: str(token)}, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert ("parameter server 0 refuses to start without the job key: $ELASTICDL_JOB_KEY_FILE is not set"
            in result.stderr)
    assert not (tmp_path / "ready").exists()  # it never served
