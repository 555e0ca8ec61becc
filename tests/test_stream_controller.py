"""The controller with a stream's ledger, event by event: no epoch end while the stream is open,
the job's end once it closes (idle) or once `elasticdl stop` asks, and the stop's way in."""

from __future__ import annotations

import grpc
import pytest

from elasticdl.data.sources import Shard
from elasticdl.master import controller as c
from elasticdl.master.evaluation_service import TaskDispatcher
from elasticdl.master.instance_manager import InstanceManager
from elasticdl.master.servicer import MasterServicer
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.tasks import NoTask
from tests.test_controller import FakeClock, answer, exit_of, of, report, take

P0 = "kafka://b:9092/t#0"


def _make(workers: int = 1):
    clock = FakeClock()
    ledger = StreamTaskManager(clock=clock, gate_epochs=True, fences_pushes=True)
    dispatcher = TaskDispatcher(ledger, None)
    ctl = c.Controller("train", dispatcher, InstanceManager(workers), clock=clock)
    return ctl, dispatcher, ledger


def test_an_open_stream_has_no_epoch_end_and_its_close_ends_the_job():
    ctl, dispatcher, ledger = _make()
    ctl.start()
    assert dispatcher.get_task(0) is NoTask.WAIT  # nothing cut yet: ask again
    ledger.add([Shard(P0, 0, 10)])
    task = take(dispatcher, 0)
    decisions = answer(ctl, report(ctl, dispatcher, task, 0))
    assert of(decisions, c.EndEpoch) == []  # every task done, the stream open: no epoch end
    assert not dispatcher.finished
    ledger.close_stream("no new record for 3 s (--stream_idle_secs)")
    decisions = answer(ctl, ctl.step(c.Tick()))
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]
    assert dispatcher.finished
    assert ctl.step(exit_of(0)) == [c.Finish()]


def test_a_stop_lets_the_task_in_progress_finish_then_ends_the_job():
    ctl, dispatcher, ledger = _make()
    ctl.start()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    task = take(dispatcher, 0)
    ctl.step(c.StopRequested("elasticdl stop"))
    assert not ledger.stream_open and ledger.add([Shard(P0, 20, 30)]) == 0
    decisions = answer(ctl, report(ctl, dispatcher, task, 0))
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]
    assert dispatcher.finished and ledger.epochs[0].records_done == 10  # the task not started was dropped
    assert ctl.step(exit_of(0)) == [c.Finish()]


class _Context:
    def abort(self, code, details):
        raise grpc.RpcError(code, details)


def test_the_masters_stop_call_asks_the_job_and_answers_its_refusal():
    asked = []

    def stop(reason: str) -> str:
        if asked:
            raise ValueError("`elasticdl stop` ends training jobs; this is `elasticdl evaluate`")
        asked.append(reason)
        return "stopping job j"

    from elasticdl.proto import elasticdl_pb2

    servicer = MasterServicer(None, None, frozenset, stop=stop)
    reply = servicer.stop(elasticdl_pb2.StopRequest(reason="elasticdl stop"), _Context())
    assert (reply.accepted, reply.message, asked) == (True, "stopping job j", ["elasticdl stop"])
    refused = servicer.stop(elasticdl_pb2.StopRequest(), _Context())
    assert not refused.accepted and "ends training jobs" in refused.message
    with pytest.raises(grpc.RpcError):
        MasterServicer(None, None, frozenset).stop(elasticdl_pb2.StopRequest(), _Context())


def test_elasticdl_stop_on_a_job_that_is_not_running_exits_2_saying_why(monkeypatch, tmp_path, capsys):
    from elasticdl import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["stop", "--job_name", "nojob"]) == 2
    assert capsys.readouterr().err.startswith("elasticdl stop: error: no running job 'nojob' here")
    (tmp_path / "runs" / "done").mkdir(parents=True)
    (tmp_path / "runs" / "done" / "report.json").write_text('{"status": "succeeded"}')
    assert cli.main(["stop", "--job_name", "done"]) == 2
    assert capsys.readouterr().err.startswith(
        "elasticdl stop: error: job 'done' has ended (succeeded): there is nothing to stop")
