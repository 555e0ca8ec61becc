"""When a worker pulls: in sync mode a push that answered with the parameters replaces the
pull of the next batch of the same task; async and SSP workers pull before every batch."""

from __future__ import annotations

import numpy as np

from elasticdl.worker.master_client import TaskOrder
from elasticdl.worker.ps_client import PullResult, PushAnswer
from elasticdl.worker.staleness import StalenessStrategy
from elasticdl.worker.worker import Worker


class _Trainer:
    built = True

    def __init__(self):
        self.embeddings = type("Tables", (), {"snapshot_id": 0, "infos": {}})()
        self.params = None

    def connect(self, ps):
        pass

    def compute_gradients(self, features, labels):
        return 0.5, {"w": np.ones(2, np.float32)}

    def set_params(self, params):
        self.params = params


class _PS:
    """One PS whose version moves with every push (async); it answers pushes with parameters."""

    num_ps = 1

    def __init__(self):
        self.version = 0
        self.pulls = 0

    def split(self, grads):
        return [grads]

    def pull(self, versions, wait_for_newer=None, timeout=30.0):
        self.pulls += 1
        return [PullResult(True, self.version, {"w": np.full(2, self.version, np.float32)})]

    def push_gradients(self, grads_by_ps, versions, lr, worker_id, want_parameters=False):
        self.version += 1
        params = {"w": np.full(2, self.version, np.float32)} if want_parameters else None
        return {0: PushAnswer(True, self.version, "", True, params)}


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

    def report_clock(self, clock, blocked_seconds):
        if self.waits:
            self.waits -= 1
            return clock, clock - 10
        return clock, clock


def _worker(staleness: StalenessStrategy):
    ps, master = _PS(), _Master()
    spec = type("Spec", (), {"learning_rate_scheduler": None})()
    worker = Worker(0, spec=spec, trainer=_Trainer(), master=master, ps=ps, minibatch_size=2, staleness=staleness)
    return worker, ps, master


def test_sync_pushes_that_answer_with_parameters_replace_the_pull():
    worker, ps, _ = _worker(StalenessStrategy())
    for _ in range(4):
        worker.train_batch(None, None)
    assert ps.pulls == 1  # before the first batch only: each push's answer was the model it made
    assert worker.versions == [4] and worker.trainer.params["w"][0] == 4


def test_async_pulls_before_every_batch_to_see_the_others_pushes():
    worker, ps, _ = _worker(StalenessStrategy(use_async=True))
    for _ in range(4):
        worker.train_batch(None, None)
        ps.version += 1  # another worker pushes
    assert ps.pulls == 3  # pulled right before each batch, so it saw the other worker's update
    assert worker.trainer.params["w"][0] == 6


def test_ssp_pulls_after_waiting_for_slower_workers():
    worker, ps, master = _worker(StalenessStrategy(use_async=True, staleness_bound=2))
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

    worker, ps, master = _worker(StalenessStrategy())
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
