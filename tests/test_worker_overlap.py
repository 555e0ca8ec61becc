"""--overlap_communication: a batch's push (and the pull after it) runs on a background thread
while the next batch computes. Driven step by step with a fake PS whose pushes wait on gates
the test opens: at most one exchange in flight, each settled before the next starts and before
a task is reported, and a background error handled on the worker's thread as a synchronous
push's would be."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.master_client import TaskOrder
from elasticdl.rpc.ps_client import PullResult, PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.consistency import ConsistencyPolicy
from elasticdl.worker.worker import Worker

WAIT = 10.0  # seconds an event may take before the test fails (it is set in microseconds)


class _Trainer:
    built = True

    def __init__(self, log):
        self.embeddings = type("Tables", (), {"snapshot_id": 0, "infos": {}})()
        self.log = log
        self.params = None
        self.computed = 0
        self.computing = threading.Semaphore(0)  # released as each batch is computed
        self.computed_on = []  # the parameters ("w"[0]: the PS version they came from) of each batch

    def connect(self, ps):
        pass

    def compute_gradients(self, features, labels):
        self.computed += 1
        self.computed_on.append(None if self.params is None else int(self.params["w"][0]))
        self.log.append(f"compute {self.computed}")
        self.computing.release()
        return 0.5, {"w": np.full(2, self.computed, np.float32)}  # batch k's gradient: k

    def apply_locally(self, grads, learning_rate):
        pass

    def set_params(self, params):
        self.params = params


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class _PS:
    """One async PS. Push k waits for ``gates[k-1]`` when it is given (None: answer at once)."""

    num_ps = 1

    def __init__(self, log):
        self.log = log
        self.version = 0
        self.gates: list[threading.Event | None] = []
        self.entered = threading.Semaphore(0)  # released as each push call begins
        self.calls = 0
        self.active = self.most_active = 0
        self.lock = threading.Lock()
        self.refusals = []  # outcomes of the next pushes
        self.unreachable = 0  # the next pushes fail: the PS is down
        self.pushes = []  # (gradient "w"[0], the versions it was computed on, its position) of each taken
        self.pull_versions = []
        self.pull_gate: threading.Event | None = None  # pulls wait for it when it is given
        self.pull_entered = threading.Semaphore(0)

    def split(self, grads):
        return [grads]

    def pull(self, versions, wait_for_newer=None, timeout=30.0):
        self.pull_versions.append(list(versions))
        self.pull_entered.release()
        if self.pull_gate is not None:
            assert self.pull_gate.wait(WAIT), "the test never opened the pull gate"
        self.log.append(f"pull v{self.version}")
        return [PullResult(True, self.version, {"w": np.full(2, self.version, np.float32)})]

    def push_gradients(self, grads_by_ps, versions, lr, worker_id, want_parameters=False, batch=None):
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            gate = self.gates[self.calls] if self.calls < len(self.gates) else None
            self.calls += 1
        self.entered.release()
        try:
            if gate is not None:
                assert gate.wait(WAIT), "the test never opened the gate"
            if self.unreachable:
                self.unreachable -= 1
                raise _Unavailable()
            if self.refusals:
                return {0: PushAnswer(self.refusals.pop(0), self.version, "refused by the test")}
            if batch is not None and any(b == batch for _, _, b in self.pushes):
                return {0: PushAnswer(PushOutcome.ACCEPTED, self.version, "")}  # its mark is past it: taken once
            self.version += 1
            grad = int(grads_by_ps[0]["w"][0])
            self.pushes.append((grad, list(versions), batch))
            self.log.append(f"push {grad}")
            return {0: PushAnswer(PushOutcome.APPLIED, self.version, "")}
        finally:
            with self.lock:
                self.active -= 1


class _Master:
    def __init__(self, log):
        self.log = log
        self.orders = []
        self.reports = []
        self.behind = 0  # the slowest worker is 10 batches back for the next `behind` clock reports

    def get_task(self):
        return self.orders.pop(0) if self.orders else TaskOrder("end")

    def report(self, task_id, records, err_message="", *rest, **kwargs):
        self.log.append("report")
        self.reports.append((task_id, records, err_message))

    def report_progress(self, task_id, records, version):
        pass

    def report_clock(self, clock, blocked_seconds):
        if self.behind:
            self.behind -= 1
            return clock, clock - 10
        return clock, clock


def _worker(sync: bool = False, **policy):
    log = []
    ps, master = _PS(log), _Master(log)
    spec = type("Spec", (), {"learning_rate_scheduler": None, "module_path": "fake.py"})()
    consistency = ConsistencyPolicy(**policy) if sync else ConsistencyPolicy(use_async=True, overlap=True, **policy)
    worker = Worker(0, spec=spec, trainer=_Trainer(log), master=master, ps=ps, minibatch_size=2,
                    consistency=consistency)
    worker._pull()  # hold version 0, as after the first pull
    log.clear()
    ps.pull_entered = threading.Semaphore(0)
    return worker, ps, master, log


def _task(worker, order: TaskOrder, batches: int, stop_after: int | None = None):
    """Feed train_task ``batches`` batches of 2 records, as _run_batches does."""
    def run_batches(order, mode, step):
        for i in range(batches):
            if i == stop_after:
                worker.request_stop()  # SIGTERM during this batch
            if not step((None, None), 2 * (i + 1)):
                return
    worker._run_batches = run_batches
    worker.master.orders = [order]


def test_the_next_batch_computes_while_the_exchange_is_in_flight_and_one_at_most():
    worker, ps, _, log = _worker()
    gate1 = threading.Event()
    ps.gates = [gate1]
    worker.train_batch(None, None)  # batch 1 computes on version 0; its push waits at the gate
    assert ps.entered.acquire(timeout=WAIT)
    assert (worker.consistency.in_flight, worker.pushes, ps.pushes) == (1, 0, [])

    second = threading.Thread(target=worker.train_batch, args=(None, None))
    second.start()
    # Batch 2 is computed while push 1 cannot have ended (its gate is shut) ...
    assert worker.trainer.computing.acquire(timeout=WAIT) and worker.trainer.computing.acquire(timeout=WAIT)
    # ... and push 2 does not start before push 1 is settled.
    assert ps.calls == 1
    gate1.set()
    second.join(WAIT)
    assert not second.is_alive()
    assert log[:4] == ["compute 1", "compute 2", "push 1", "pull v1"]
    worker.train_batch(None, None)
    worker._settle_exchange()
    assert ps.most_active == 1
    # Batch 2 missed batch 1's update (computed on version 0, pushed as such: the PS counts its
    # staleness); batch 3 used the pull that followed push 1.
    assert worker.trainer.computed_on == [0, 0, 1]
    assert [(grad, versions) for grad, versions, _ in ps.pushes] == [(1, [0]), (2, [0]), (3, [1])]
    assert (worker.pushes, worker.batches_trained, worker.consistency.clock, worker.versions) == (3, 3, 3, [3])


def test_a_second_exchange_cannot_start_while_one_is_in_flight():
    policy = ConsistencyPolicy(use_async=True, overlap=True)
    policy.exchange_started()
    with pytest.raises(RuntimeError, match="already in flight"):
        policy.exchange_started()


def test_a_task_is_reported_after_its_last_exchange_settled():
    worker, ps, master, log = _worker()
    _task(worker, TaskOrder("training", task_id=3, start=100, end=106, handout=9), 3)
    worker.run()
    assert log.index("push 3") < log.index("report")
    assert [b for _, _, b in ps.pushes] == [BatchPosition(3, 9, 102 + 2 * i, 2) for i in range(3)]
    assert master.reports == [(3, 6, "")] and worker.consistency.in_flight == 0


def test_a_worker_told_to_leave_settles_the_exchange_before_it_reports_the_prefix():
    worker, ps, master, log = _worker()
    _task(worker, TaskOrder("training", task_id=3, start=100, end=112, handout=9), 6, stop_after=1)
    worker.run()
    assert [b for _, _, b in ps.pushes] == [BatchPosition(3, 9, 102, 2), BatchPosition(3, 9, 104, 2)]
    assert log[-1] == "report" and master.reports == [(3, 4, "")]  # the master requeues 104-112


def test_a_fenced_exchange_takes_the_task_back_without_a_report():
    worker, ps, master, _ = _worker()
    ps.refusals = [PushOutcome.REJECTED_FENCED]  # push 1, settled while batch 2 computes
    _task(worker, TaskOrder("training", task_id=3, start=100, end=106, handout=9), 3)
    worker.run()
    assert master.reports == [] and ps.pushes == []  # another hand-out trains the records
    assert worker.consistency.in_flight == 0 and worker.consistency.must_pull()


def test_a_background_push_to_an_unreachable_ps_is_pushed_again_not_computed_again(monkeypatch):
    monkeypatch.setattr("elasticdl.worker.worker.time.sleep", lambda seconds: None)
    worker, ps, _, _ = _worker()
    gate1 = threading.Event()
    ps.gates = [gate1]
    worker.train_batch(None, None)
    ps.unreachable = 1  # the PS restarts during push 1, in the background
    gate1.set()
    worker.train_batch(None, None)  # push 1 fails when it is settled, and is pushed again
    worker._settle_exchange()
    assert worker.trainer.computed == 2 and [grad for grad, _, _ in ps.pushes] == [1, 2]
    assert ps.pull_versions[-2] == [-1]  # after the reconnect the pull asks for everything


@pytest.mark.parametrize("overlap", [False, True], ids=["sync-push", "overlapped"])
def test_a_push_refused_in_the_background_fails_the_task_as_a_synchronous_push_does(overlap):
    worker, ps, master, _ = _worker()
    worker.consistency.overlap = overlap
    ps.refusals = [PushOutcome.REJECTED_INVALID]
    _task(worker, TaskOrder("training", task_id=3, start=100, end=106, handout=9), 3)
    worker.run()
    # Overlapped, the refusal of push 1 surfaces once batch 2 is trained (the PS's mark says what was applied).
    assert master.reports == [(3, 2 * overlap, "PushRejectedError: PS 0 rejected the gradients "
                                                        "(REJECTED_INVALID): refused by the test")]
    assert worker.consistency.in_flight == 0


def test_ssp_counts_the_exchange_in_flight_as_one_version_of_lag():
    policy = ConsistencyPolicy(use_async=True, staleness_bound=2, overlap=True)
    assert not policy.must_wait(5, 3)
    policy.exchange_started()  # its batch is not in the clock yet, and the next misses its update
    assert policy.must_wait(5, 4) and not policy.must_wait(5, 5)


def test_an_ssp_worker_settles_its_exchange_before_it_waits_and_pulls_after(monkeypatch):
    monkeypatch.setattr("elasticdl.worker.worker.time.sleep", lambda seconds: None)
    worker, ps, master, log = _worker(staleness_bound=2)
    worker.train_batch(None, None)
    master.behind = 2  # the slowest worker is far behind for two clock reports
    worker.train_batch(None, None)
    assert log == ["compute 1", "push 1", "pull v1", "pull v1", "compute 2"]  # settled, waited, pulled
    assert worker.consistency.in_flight == 1 and worker.trainer.computed_on == [0, 1]


def test_a_sync_task_asks_for_its_first_pull_while_its_records_are_read():
    worker, ps, master, log = _worker(sync=True)
    ps.pull_gate = threading.Event()

    def run_batches(order, mode, step):
        assert ps.pull_entered.acquire(timeout=2.0)  # asked for before the records are read
        log.append("records read")
        ps.pull_gate.set()
        for i in range(2):
            step((None, None), 2 * (i + 1))

    worker._run_batches = run_batches
    master.orders = [TaskOrder("training", task_id=3, start=100, end=104, handout=9)]
    worker.run()
    assert log == ["records read", "pull v0", "compute 1", "push 1", "pull v1", "compute 2", "push 2", "report"]
    assert len(ps.pull_versions) == 3  # the first pull, the prefetched one (batch 1), batch 2's: none more


def test_a_prefetched_pull_made_stale_by_a_reconnect_is_not_used():
    worker, ps, _, _ = _worker(sync=True)
    worker._prefetch_first_pull()
    worker.consistency.ps_reconnected()  # what it was asked on no longer holds
    worker.train_batch(None, None)
    assert ps.pull_versions[1:] == [[0], [-1]]  # the prefetched one, then everything again
