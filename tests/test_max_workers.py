"""--max_workers caps the workers a job may have: at submit time and for every `elasticdl scale`."""

from __future__ import annotations

import pytest

from elasticdl.config import ConfigError, JobConfig
from elasticdl.master.job import Job
from elasticdl.master.preflight import CheckedJob
from elasticdl.master.servicer import MasterServicer
from elasticdl.proto import elasticdl_pb2


def config(**flags) -> JobConfig:
    base = dict(model_zoo="zoo", model_def="pkg.module.custom_model", training_data="data", job_name="capped")
    return JobConfig.from_flags(**{**base, **flags}).with_defaults()


def test_the_default_cap_is_64_workers():
    assert config().elasticity.max_workers == 64
    config(num_workers=64).validate(check_paths=False)


@pytest.mark.parametrize("flags, limit", [({"num_workers": 65}, 64), ({"num_workers": 5, "max_workers": 4}, 4)])
def test_more_workers_than_the_cap_are_refused_at_submit(flags, limit):
    with pytest.raises(ConfigError, match=rf"--num_workers {flags['num_workers']} is more than --max_workers {limit}"):
        config(**flags).validate(check_paths=False)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"--max_workers must be at least 1\b.*Received: max_workers=0"):
        config(max_workers=0).validate(check_paths=False)


class _NoBackend:
    """request_scale only queues an event: nothing may be started."""


def job(**flags) -> Job:
    cfg = config(**flags)
    return Job(CheckedJob(cfg, None, None, [("data", 10)], None), backend=_NoBackend())


def test_scale_above_the_cap_is_refused_and_changes_nothing():
    j = job(num_workers=2, max_workers=4)
    with pytest.raises(ValueError, match=r"--num_workers 5 is more than --max_workers 4: ask for at most 4 workers"):
        j.request_scale(5)
    assert j._events.empty()  # no ScaleRequested: the job keeps its workers
    assert j.request_scale(4) == "scaling job capped to 4 workers"
    assert j._events.qsize() == 1


class _Context:
    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_the_master_answers_scale_above_the_cap_with_a_refusal_naming_the_flag():
    j = job(num_workers=1, max_workers=3)
    servicer = MasterServicer(j.requests, j.clocks, lambda: j.desk.active_workers, scale=j.request_scale)
    reply = servicer.scale(elasticdl_pb2.ScaleRequest(num_workers=100), _Context())
    assert not reply.accepted and "--max_workers 3" in reply.message
    assert j._events.empty()
    assert servicer.scale(elasticdl_pb2.ScaleRequest(num_workers=3), _Context()).accepted


def test_elasticdl_scale_above_the_cap_exits_2_naming_the_flag(tmp_path, monkeypatch, capsys):
    """Over real gRPC: `elasticdl scale` to the master of a job started with --max_workers 3."""
    from elasticdl import cli
    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc import channel as grpc_utils

    monkeypatch.chdir(tmp_path)  # no runs/capped/: the address is given, the token is the tests'
    j = job(num_workers=1, max_workers=3)
    server = grpc_utils.make_server()
    servicer = MasterServicer(j.requests, j.clocks, lambda: j.desk.active_workers, scale=j.request_scale)
    elasticdl_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    address = f"127.0.0.1:{grpc_utils.bind_local(server)}"
    server.start()
    try:
        argv = ["scale", "--job_name", "capped", "--master_addr", address, "--num_workers"]
        assert cli.main([*argv, "4"]) == 2
        assert "--num_workers 4 is more than --max_workers 3" in capsys.readouterr().err
        assert j._events.empty()
        assert cli.main([*argv, "3"]) == 0
        assert "scaling job capped to 3 workers" in capsys.readouterr().out
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("shuffle", [True, False])
def test_shuffle_tasks_false_hands_tasks_out_in_the_datas_order(shuffle):
    """--shuffle_tasks false (a time-ordered log replayed as it happened): files in their order,
    records in file order; the default shuffles them, as model.fit does."""
    cfg = config(shuffle_tasks=shuffle, records_per_task=10)
    j = Job(CheckedJob(cfg, None, None, [("a", 50), ("b", 50)], None), backend=_NoBackend())
    j.main_tasks.open_epoch(1)
    handed = []
    for _ in range(10):
        task = j.main_tasks.get_task(0)
        handed.append((task.shard.path, task.shard.start))
        j.main_tasks.report(task.task_id, 0, records=10, handout=task.handout)
    in_order = [(path, start) for path in "ab" for start in range(0, 50, 10)]
    assert sorted(handed) == in_order
    assert (handed == in_order) is not shuffle
