"""The worker's progress reports: one background thread, only the latest count is sent."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.rpc.master_client import _ProgressReporter


class _SlowStub:
    """Records report_progress calls; the first one blocks until released."""

    def __init__(self, fail_first: bool = False):
        self.sent: list[tuple[int, int]] = []
        self.release = threading.Event()
        self.fail_first = fail_first

    def report_progress(self, request, timeout):
        first = not self.sent
        self.sent.append((request.task_id, request.records_done))
        if first:
            self.release.wait(5)
            if self.fail_first:
                raise _Unavailable()


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def _wait_for(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_reports_overtaken_while_one_is_in_flight_collapse_to_the_latest():
    stub = _SlowStub()
    reporter = _ProgressReporter(stub, worker_id=4)
    reporter.post(7, 64)
    _wait_for(lambda: stub.sent == [(7, 64)])
    for done in (128, 192, 256):  # the first call is still in flight
        reporter.post(7, done)
    stub.release.set()
    _wait_for(lambda: len(stub.sent) == 2)
    time.sleep(0.05)
    assert stub.sent == [(7, 64), (7, 256)]
    reporter.stop()


def test_a_task_result_drops_its_unsent_progress_and_errors_are_not_fatal():
    stub = _SlowStub(fail_first=True)
    reporter = _ProgressReporter(stub, worker_id=0)
    reporter.post(1, 10)
    _wait_for(lambda: len(stub.sent) == 1)
    reporter.post(1, 20)
    reporter.forget(1)  # the task's result is being reported: its progress is moot
    reporter.post(2, 5)
    stub.release.set()  # the first call fails (the master is away): the thread goes on
    _wait_for(lambda: len(stub.sent) == 2)
    time.sleep(0.05)
    assert stub.sent == [(1, 10), (2, 5)]
    reporter.stop()
    reporter._thread.join(2)
    assert not reporter._thread.is_alive()


def test_progress_and_results_reach_the_job_loop_as_events_over_grpc():
    """The worker's model version rides on its progress reports: the master's controller gets a
    VersionReported event per report, and a TaskReported per result, without polling anyone."""
    import queue

    from master_loop import master_servicer

    from elasticdl.data.sources import Shard
    from elasticdl.master.clocks import WorkerClocks
    from elasticdl.master.controller import TaskReported, VersionReported
    from elasticdl.master.evaluation_service import TaskDispatcher
    from elasticdl.master.progress import TrainingProgress
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc.channel import bind_local, make_server
    from elasticdl.rpc.master_client import MasterClient

    events: queue.SimpleQueue = queue.SimpleQueue()
    dispatcher = TaskDispatcher(TaskManager([Shard("f", 0, 10)], shuffle=False), None)
    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        master_servicer(dispatcher, TrainingProgress(10, 1), WorkerClocks(), notify=events.put), server
    )
    port = bind_local(server)
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", worker_id=3)
    try:
        order = client.get_task()
        client.report_progress(order.task_id, 5, model_version=17)
        assert events.get(timeout=10) == VersionReported(17)
        client.report(order.task_id, 10, "", 0.5, 2, 17)
        assert events.get(timeout=10) == TaskReported(order.task_id, 3, True)
        assert dispatcher.main.finished
    finally:
        client.close()
        server.stop(grace=None)


def test_a_task_comes_with_the_range_of_the_next_one_to_read_ahead_over_grpc(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from master_loop import master_servicer

    from elasticdl.data.sources import Shard, count_records
    from elasticdl.master.clocks import WorkerClocks
    from elasticdl.master.evaluation_service import TaskDispatcher
    from elasticdl.master.progress import TrainingProgress
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc.channel import bind_local, make_server
    from elasticdl.rpc.master_client import MasterClient

    f = str(tmp_path / "f.parquet")
    pq.write_table(pa.table({"x": list(range(20))}), f, row_group_size=10)
    assert count_records(f) == 20  # the master read its footer, cutting the tasks
    dispatcher = TaskDispatcher(TaskManager([Shard(f, 0, 10), Shard(f, 10, 20)], shuffle=False), None)
    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        master_servicer(dispatcher, TrainingProgress(20, 1), WorkerClocks()), server)
    port = bind_local(server)
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", worker_id=0)
    try:
        first = client.get_task()
        assert (first.start, first.end, first.read_ahead) == (0, 10, (f, 10, 20))
        ((path, size, footer),) = first.footers  # the file's footer, once for both tasks
        assert path == f and pq.read_metadata(pa.BufferReader(footer)).num_rows == 20
        client.report(first.task_id, 10, "", 0.5, 2, 1)
        second = client.get_task()
        assert (second.start, second.end, second.read_ahead, second.footers) == (10, 20, None, ())
        dispatcher.recover_worker_tasks(0)  # the worker exited: a process under its id gets them again
        assert [p for p, _, _ in dispatcher.footers_for(0, [f])] == [f]
    finally:
        client.close()
        server.stop(grace=None)


class _AwayOnce(elasticdl_pb2_grpc.MasterServicer):
    """A master that answers each call first with ``code`` (busy, restarting, frozen), then properly."""

    def __init__(self, code):
        self.code = code
        self.calls: list[str] = []

    def _away_first(self, name: str, context) -> None:
        self.calls.append(name)
        if self.calls.count(name) == 1:
            context.abort(self.code, "the job loop did not take the request")

    def get_task(self, request, context):
        self._away_first("get_task", context)
        return elasticdl_pb2.Task(type=elasticdl_pb2.END)

    def report_task_result(self, request, context):
        self._away_first("report_task_result", context)
        return elasticdl_pb2.ReportTaskResultResponse(accepted=True)

    def report_clock(self, request, context):
        self._away_first("report_clock", context)
        return elasticdl_pb2.ReportClockResponse(clock=5, slowest_clock=3)


def _client_of(master):
    from elasticdl.rpc.channel import bind_local, make_server
    from elasticdl.rpc.master_client import MasterClient

    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(master, server)
    port = bind_local(server)
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", worker_id=0)
    pauses: list[float] = []
    client._sleep = pauses.append  # no real pause
    return server, client, pauses


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_every_call_to_a_master_that_is_away_is_tried_again(code):
    """The master's loop may be busy with a long decision (UNAVAILABLE after its deadline), or the
    master frozen (DEADLINE_EXCEEDED): get_task, report and report_clock each ask again."""
    master = _AwayOnce(code)
    server, client, pauses = _client_of(master)
    try:
        assert client.get_task().kind == "end"
        assert client.report(1, 10) is True
        assert client.report_clock(4) == (5, 3)
        assert master.calls == ["get_task"] * 2 + ["report_task_result"] * 2 + ["report_clock"] * 2
        assert pauses == [0.1, 0.1, 0.1]
    finally:
        client.close()
        server.stop(grace=None)


def test_a_master_away_past_the_retry_budget_or_refusing_fails_the_call():
    master = _AwayOnce(grpc.StatusCode.UNAVAILABLE)
    server, client, pauses = _client_of(master)
    client.retry_seconds = 0.0
    try:
        with pytest.raises(grpc.RpcError) as raised:
            client.get_task()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and pauses == []
        master.code = grpc.StatusCode.PERMISSION_DENIED  # not an absence: never tried again
        client.retry_seconds = 60.0
        with pytest.raises(grpc.RpcError) as raised:
            client.report_clock(1)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED and pauses == []
    finally:
        client.close()
        server.stop(grace=None)


def test_a_request_the_job_loop_did_not_take_in_time_fails_unavailable_and_the_worker_asks_again():
    """Over real gRPC: the servicer withdraws a request its loop did not take (LoopBusy) and
    answers UNAVAILABLE; the worker's client asks again and gets its task."""
    from master_loop import serving_loop

    from elasticdl.data.sources import Shard
    from elasticdl.master.clocks import WorkerClocks
    from elasticdl.master.evaluation_service import TaskDispatcher
    from elasticdl.master.request_desk import RequestDesk
    from elasticdl.master.requests import LoopBusy
    from elasticdl.master.servicer import MasterServicer
    from elasticdl.master.task_manager import TaskManager
    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc.channel import bind_local, make_server
    from elasticdl.rpc.master_client import MasterClient

    desk = RequestDesk(TaskDispatcher(TaskManager([Shard("f", 0, 10)], shuffle=False), None))
    line = serving_loop(desk)
    asked: list[str] = []

    class BusyOnce:
        def ask(self, request, timeout):
            asked.append(type(request).__name__)
            if asked.count(asked[-1]) == 1:
                raise LoopBusy("the master's job loop did not take the request within 11s")
            return line.ask(request, timeout)

    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        MasterServicer(BusyOnce(), WorkerClocks(), lambda: desk.active_workers), server)
    port = bind_local(server)
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", worker_id=0)
    client._sleep = lambda seconds: None
    try:
        order = client.get_task()
        assert (order.kind, order.start, order.end) == ("training", 0, 10)
        assert client.report(order.task_id, 10, handout=order.handout) is True
        assert asked == ["GetTask", "GetTask", "ReportTask", "ReportTask"]
        assert desk.active_workers == frozenset()
    finally:
        client.close()
        server.stop(grace=None)


def test_a_worker_gets_the_masters_preprocessing_state_over_grpc_in_chunks_once_it_is_built():
    """What a worker in another pod gets (no shared directory): the master's bytes, whole, even
    above the chunk size; asked again while the master still builds its model; only with the
    worker's credential."""
    import numpy as np

    from elasticdl.master.clocks import WorkerClocks
    from elasticdl.master.servicer import STATE_CHUNK_BYTES, MasterServicer
    from elasticdl.model.preprocessing_state import PreprocessingState
    from elasticdl.rpc import trust
    from elasticdl.rpc.channel import bind_local, make_server
    from elasticdl.rpc.master_client import MasterClient

    vocabulary = np.asarray([f"token-{i}" for i in range(80_000)])  # ~3.5 MB of unicode: several chunks
    state = PreprocessingState({"module.lookup/0:StringLookup|vocabulary": vocabulary}).to_bytes()
    assert len(state) > 2 * STATE_CHUNK_BYTES
    asked = []

    def built():
        asked.append(len(asked))
        return None if len(asked) == 1 else state  # the first ask comes before the model is built

    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        MasterServicer(None, WorkerClocks(), frozenset, job_key="k", preprocessing_state=built), server)
    port = bind_local(server)
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", worker_id=1, credential=trust.worker_credential("k", 1))
    client._sleep = lambda seconds: None
    stranger = MasterClient(f"127.0.0.1:{port}", worker_id=1, credential="forged")
    try:
        got = PreprocessingState.from_bytes(client.preprocessing_state())
        np.testing.assert_array_equal(got.arrays["module.lookup/0:StringLookup|vocabulary"], vocabulary)
        assert len(asked) == 2
        with pytest.raises(grpc.RpcError) as refused:
            stranger.preprocessing_state()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        client.close()
        stranger.close()
        server.stop(grace=None)
