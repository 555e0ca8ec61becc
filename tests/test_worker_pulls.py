"""When a worker pulls: in sync mode a push that answered with the parameters replaces the
pull of the next batch of the same task; async and SSP workers pull before every batch."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.master_client import TaskOrder
from elasticdl.rpc.ps_client import PullResult, PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.consistency import ConsistencyPolicy, PushRejectedError
from elasticdl.worker.worker import Worker


class _Trainer:
    built = True

    def __init__(self):
        self.embeddings = type("Tables", (), {"snapshot_id": 0, "infos": {}})()
        self.params = None
        self.computed = 0
        self.applied_locally = 0

    def connect(self, ps):
        pass

    def compute_gradients(self, features, labels):
        self.computed += 1
        return 0.5, {"w": np.full(2, self.computed, np.float32)}  # batch k's gradient: k

    def apply_locally(self, grads, learning_rate):
        self.applied_locally += 1

    def set_params(self, params):
        self.params = params


class _PS:
    """One PS whose version moves with every push (async); it answers pushes with parameters."""

    num_ps = 1

    def __init__(self):
        self.version = 0
        self.pulls = 0
        self.pull_versions = []  # the versions each pull sent
        self.refusals = []  # outcomes of the next pushes, refused before they change anything
        self.unreachable = 0  # the next pushes fail: the PS is down
        self.pushes = []  # (the gradients, the batch position) of each push taken

    def split(self, grads):
        return [grads]

    def pull(self, versions, wait_for_newer=None, timeout=30.0):
        self.pulls += 1
        self.pull_versions.append(list(versions))
        return [PullResult(True, self.version, {"w": np.full(2, self.version, np.float32)})]

    def push_gradients(self, grads_by_ps, versions, lr, worker_id, want_parameters=False, batch=None):
        if self.unreachable:
            self.unreachable -= 1
            raise _Unavailable()
        if self.refusals:
            return {0: PushAnswer(self.refusals.pop(0), self.version, "stale gradient (or not)")}
        self.version += 1
        self.pushes.append(({n: np.array(g) for n, g in grads_by_ps[0].items()}, batch))
        params = {"w": np.full(2, self.version, np.float32)} if want_parameters else None
        return {0: PushAnswer(PushOutcome.APPLIED, self.version, "", params)}


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class _Master:
    """Clocks: the slowest worker is 10 batches back for the next `waits` calls."""

    def __init__(self):
        self.waits = 0
        self.orders = []
        self.reports = []

    def get_task(self):
        return self.orders.pop(0) if self.orders else TaskOrder("end")

    def report(self, task_id, records, err_message="", *rest, **kwargs):
        self.reports.append((task_id, err_message))
        self.reported_records = records

    def report_progress(self, task_id, records, version):
        pass

    def report_clock(self, clock, blocked_seconds):
        if self.waits:
            self.waits -= 1
            return clock, clock - 10
        return clock, clock


def _worker(consistency: ConsistencyPolicy):
    ps, master = _PS(), _Master()
    spec = type("Spec", (), {"learning_rate_scheduler": None})()
    worker = Worker(0, spec=spec, trainer=_Trainer(), master=master, ps=ps, minibatch_size=2, consistency=consistency)
    return worker, ps, master


def test_sync_pushes_that_answer_with_parameters_replace_the_pull():
    worker, ps, _ = _worker(ConsistencyPolicy())
    for _ in range(4):
        worker.train_batch(None, None)
    assert ps.pulls == 1  # before the first batch only: each push's answer was the model it made
    assert worker.versions == [4] and worker.trainer.params["w"][0] == 4


def test_async_pulls_before_every_batch_to_see_the_others_pushes():
    worker, ps, _ = _worker(ConsistencyPolicy(use_async=True))
    for _ in range(4):
        worker.train_batch(None, None)
        ps.version += 1  # another worker pushes
    assert ps.pulls == 3  # pulled right before each batch, so it saw the other worker's update
    assert worker.trainer.params["w"][0] == 6


def test_ssp_pulls_after_waiting_for_slower_workers():
    worker, ps, master = _worker(ConsistencyPolicy(use_async=True, staleness_bound=2))
    worker.train_batch(None, None)
    worker.train_batch(None, None)
    ps.version += 5  # the slower workers push while this one waits
    master.waits = 1
    pulls = ps.pulls
    worker.train_batch(None, None)
    assert ps.pulls == pulls + 1 and worker.trainer.params["w"][0] == 7  # computed on version 7
    assert worker.blocked_seconds > 0


def test_sync_pulls_at_the_start_of_each_task():
    """Between two tasks the others may push many versions: the last answer is no longer fresh."""
    from elasticdl.worker.worker import TaskResult

    worker, ps, master = _worker(ConsistencyPolicy())
    pulls_before_batch = []

    def train_task(order):
        for _ in range(3):
            pulls_before_batch.append(ps.pulls)
            worker.train_batch(None, None)
        ps.version += 7  # other workers push while this one fetches its next task
        return TaskResult(records=6, batches=3)

    worker.train_task = train_task
    master.orders = [TaskOrder("training", task_id=1), TaskOrder("training", task_id=2)]
    worker.run()
    assert master.reports == [(1, ""), (2, "")]
    assert pulls_before_batch == [0, 1, 1, 1, 2, 2]  # one pull at each task's first batch
    assert worker.versions == [ps.version - 7]


def test_a_stale_push_is_computed_again_on_pulled_parameters():
    worker, ps, _ = _worker(ConsistencyPolicy())
    worker.train_batch(None, None)
    assert (ps.pulls, ps.version) == (1, 1)
    ps.version += 3  # the others moved on: this worker's next gradient is stale
    ps.refusals = [PushOutcome.REJECTED_STALE]
    worker.train_batch(None, None)
    assert ps.pull_versions[-1] == [1]  # the push's answer stood in for the first try; then a pull
    assert (ps.pulls, ps.version, worker.versions) == (2, 5, [5])


def test_a_push_refused_for_another_reason_fails_the_batch():
    worker, ps, _ = _worker(ConsistencyPolicy())
    ps.refusals = [PushOutcome.REJECTED_INVALID]
    with pytest.raises(PushRejectedError, match="PS 0 rejected the gradients"):
        worker.train_batch(None, None)
    assert worker.batches_trained == 0


def test_after_a_ps_reconnect_the_worker_pulls_everything(monkeypatch):
    monkeypatch.setattr("elasticdl.worker.worker.time.sleep", lambda seconds: None)
    worker, ps, _ = _worker(ConsistencyPolicy())
    worker.train_batch(None, None)
    worker.consistency.task_started()  # the next batch pulls: it sends the version it holds
    worker.train_batch(None, None)
    ps.unreachable = 1  # this batch's push fails; the answer to the last one stood in for its pull
    worker.train_batch(None, None)
    assert ps.pull_versions == [[-1], [1], [-1]]  # the PS may be back from an older checkpoint
    assert worker.versions == [3]


# ---------------------------------------------------------------- --push_steps


def _task_of_batches(worker, batches: int, stop_after: int | None = None, taken_back_at: int | None = None):
    """Feed train_task ``batches`` batches of 2 records (records 100.. of the file), as _run_batches does."""
    def run_batches(order, mode, step):
        for i in range(batches):
            if i == stop_after:
                worker.request_stop()  # SIGTERM during this batch
            if i == taken_back_at:
                worker.ps.refusals = [PushOutcome.REJECTED_FENCED]
            if not step((None, None), 2 * (i + 1)):
                return
    worker._run_batches = run_batches


def test_accumulated_pushes_carry_the_mean_and_the_last_batch_position():
    worker, ps, master = _worker(ConsistencyPolicy(use_async=True, push_steps=4))
    _task_of_batches(worker, 6)
    master.orders = [TaskOrder("training", task_id=3, start=100, end=112, handout=9)]
    worker.run()
    # Every 4th batch, then the task's last 2 before it is reported: nothing is left behind.
    assert [(g["w"].tolist(), b) for g, b in ps.pushes] == [  # means of batches 1-4, then 5-6
        ([2.5, 2.5], BatchPosition(3, 9, 108, 8)), ([5.5, 5.5], BatchPosition(3, 9, 112, 4)),
    ]
    assert master.reports == [(3, "")] and master.reported_records == 12
    assert (worker.trainer.computed, worker.trainer.applied_locally, worker.pushes) == (6, 6, 2)
    assert ps.pulls == 1  # after the first push (the fake trainer was built: no first pull), never between pushes


def test_accumulated_gradients_are_pushed_before_a_task_left_on_sigterm_is_reported():
    worker, ps, master = _worker(ConsistencyPolicy(use_async=True, push_steps=4))
    _task_of_batches(worker, 6, stop_after=1)
    master.orders = [TaskOrder("training", task_id=3, start=100, end=112, handout=9)]
    worker.run()
    assert [b for _, b in ps.pushes] == [BatchPosition(3, 9, 104, 4)]
    assert master.reports == [(3, "")] and master.reported_records == 4  # the master requeues 104-112


def test_accumulated_gradients_of_a_task_taken_back_are_dropped():
    worker, ps, master = _worker(ConsistencyPolicy(use_async=True, push_steps=4))
    _task_of_batches(worker, 6, taken_back_at=3)  # the push at the 4th batch is fenced
    master.orders = [TaskOrder("training", task_id=3, start=100, end=112, handout=9)]
    worker.run()
    assert ps.pushes == [] and master.reports == []  # another hand-out trains the records
    assert worker.consistency.unpushed == 0 and worker.consistency.must_pull()


def test_an_accumulated_push_that_failed_is_pushed_again_not_computed_again(monkeypatch):
    monkeypatch.setattr("elasticdl.worker.worker.time.sleep", lambda seconds: None)
    worker, ps, _ = _worker(ConsistencyPolicy(use_async=True, push_steps=2))
    worker.train_batch(None, None)
    ps.unreachable = 1  # the PS restarts during the push
    worker.train_batch(None, None)
    assert worker.trainer.computed == 2 and [g["w"].tolist() for g, _ in ps.pushes] == [[1.5, 1.5]]


def test_accumulated_rows_are_averaged_and_non_trainable_changes_summed():
    from elasticdl.model.embedding.table import IndexedRows
    from elasticdl.model.non_trainable import NonTrainableChange
    from elasticdl.worker.accumulation import GradientAccumulator

    acc = GradientAccumulator()
    for k in (1.0, 3.0):
        acc.add({"table": IndexedRows(np.array([5, 7]), np.full((2, 1), k, np.float32)),
                 "bn/moving_mean": NonTrainableChange(np.full(2, k, np.float32))}, None)
    grads, position = acc.means()
    assert position is None and acc.batches == 2
    assert grads["table"].ids.tolist() == [5, 7] and grads["table"].values.tolist() == [[2.0], [2.0]]
    assert grads["bn/moving_mean"].values.tolist() == [4.0, 4.0]  # what the 2 steps did to the copy


def test_an_accumulated_push_refused_as_stale_is_pushed_again_as_it_is_once_pulled():
    worker, ps, _ = _worker(ConsistencyPolicy(use_async=True, push_steps=2))
    worker.train_batch(None, None)
    ps.refusals = [PushOutcome.REJECTED_STALE]  # the mean of batches 1-2: too far ahead of a rolled-back PS
    worker.train_batch(None, None)
    # Applied locally already, so never computed again: the same mean, after a pull.
    assert worker.trainer.computed == 2 and [g["w"].tolist() for g, _ in ps.pushes] == [[1.5, 1.5]]
    assert ps.pulls == 1 and worker.pushes == 1 and worker.consistency.unpushed == 0
