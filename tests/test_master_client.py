"""The worker's progress reports: one background thread, only the latest count is sent."""

from __future__ import annotations

import threading
import time

import grpc

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
