"""After a parameter server reconnects (it was killed and came back, maybe rolled back to a
checkpoint), the worker pulls before it pushes, in every mode: a push sent before that pull
carries version -1, which every PS refuses ("gradient computed on version -1"), and async and
SSP jobs failed on a PS SIGKILL that way (issue 25)."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.ps_client import PullResult, PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.consistency import ConsistencyPolicy
from elasticdl.worker.worker import Worker
from tests.test_worker_pulls import _Unavailable

# Every mode and variant the worker trains in: (use_async, staleness_bound, get_model_steps,
# push_steps, overlap).
MODES = {
    "sync": lambda num_ps: ConsistencyPolicy(num_ps=num_ps),
    "async": lambda num_ps: ConsistencyPolicy(use_async=True, num_ps=num_ps),
    "async-get-model-steps": lambda num_ps: ConsistencyPolicy(use_async=True, get_model_steps=3, num_ps=num_ps),
    "ssp": lambda num_ps: ConsistencyPolicy(use_async=True, staleness_bound=2, num_ps=num_ps),
    "push-steps": lambda num_ps: ConsistencyPolicy(use_async=True, push_steps=2, num_ps=num_ps),
    "overlap": lambda num_ps: ConsistencyPolicy(use_async=True, overlap=True, num_ps=num_ps),
}


class _Trainer:
    built = True

    def __init__(self):
        self.embeddings = type("Tables", (), {"snapshot_id": 0, "infos": {}})()
        self.computed = 0

    def connect(self, ps):
        pass

    def compute_gradients(self, features, labels):
        self.computed += 1
        return 0.5, {"w": np.full(2, self.computed, np.float32)}

    def apply_locally(self, grads, learning_rate):
        pass

    def set_params(self, params):
        pass


class _PS:
    """One PS that checks the version a push names as the real one does (ps/server.py)."""

    num_ps = 1

    def __init__(self):
        self.version = 0
        self.unreachable_at_push = -1  # the push call of this index fails: the PS is down
        self.calls = 0
        self.pushed_versions = []  # the version each push call named
        self.pulls = 0

    def split(self, grads):
        return [grads]

    def pull(self, versions, wait_for_newer=None, timeout=30.0):
        self.pulls += 1
        return [PullResult(True, self.version, {"w": np.full(2, self.version, np.float32)})]

    def push_gradients(self, grads_by_ps, versions, lr, worker_id, want_parameters=False, batch=None):
        call, self.calls = self.calls, self.calls + 1
        if call == self.unreachable_at_push:
            raise _Unavailable()
        self.pushed_versions.append(versions[0])
        if versions[0] < 0:
            return {0: PushAnswer(PushOutcome.REJECTED_INVALID, self.version,
                                  f"gradient computed on version {versions[0]}: a version is never negative")}
        self.version += 1
        params = {"w": np.full(2, self.version, np.float32)} if want_parameters else None
        return {0: PushAnswer(PushOutcome.APPLIED, self.version, "", params)}


class _Master:
    def report_progress(self, task_id, records, version):
        pass

    def report_clock(self, clock, blocked_seconds):
        return clock, clock


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("down_at", [0, 1, 2])
def test_after_a_ps_reconnect_the_worker_pulls_before_it_pushes(mode, down_at, monkeypatch):
    monkeypatch.setattr("elasticdl.worker.worker.time.sleep", lambda seconds: None)  # the retry's pause
    ps = _PS()
    spec = type("Spec", (), {"learning_rate_scheduler": None})()
    worker = Worker(0, spec=spec, trainer=_Trainer(), master=_Master(), ps=ps, minibatch_size=2,
                    consistency=MODES[mode](1))
    worker._pull(everything=True)  # as _initialize_ps does
    ps.unreachable_at_push = down_at
    for batch in range(6):
        worker._batch_position = BatchPosition(1, 1, 2 * (batch + 1), 2)
        worker.train_batch(None, None)
    worker._finish_task_pushes()  # as before a task's report: the exchange settled, the accumulated pushed
    assert ps.pushed_versions and min(ps.pushed_versions) >= 0
    assert worker.pushes == (3 if mode == "push-steps" else 6)
    assert ps.pulls >= 2  # the first, and the one after the reconnect


class _OneEmptyOfTwo:
    """Two PS: the first at ``others_at``, the second relaunched empty until a ``push_model``."""

    num_ps = 2

    def __init__(self, others_at: int):
        self.others_at, self.empty, self.filled_at, self.pulls = others_at, True, None, 0

    def pull(self, versions, wait_for_newer=None, timeout=30.0):
        self.pulls += 1
        other = PullResult(True, self.others_at, {"w": np.zeros(2, np.float32)})
        mine = PullResult(not self.empty, self.filled_at or 0, {} if self.empty else {"b": np.zeros(1, np.float32)})
        return [other, mine]

    def push_model(self, params, version=0, non_trainable=()):
        self.empty, self.filled_at = False, version
        return [False, True]


def _sync_worker_of(ps) -> Worker:
    spec = type("Spec", (), {"learning_rate_scheduler": None})()
    trainer = _Trainer()
    trainer.get_params = lambda: {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}
    trainer.variables, trainer.non_trainable = {"w": None, "b": None}, set()
    return Worker(0, spec=spec, trainer=trainer, master=_Master(), ps=ps, minibatch_size=2,
                  consistency=MODES["sync"](2))


def test_a_ps_that_came_back_empty_is_refilled_at_the_version_the_others_are_at():
    """Found by the simulator (seed 191): a PS relaunched without a checkpoint was refilled at
    version 0 and stayed behind the other shards of a sync job for the rest of the job."""
    ps = _OneEmptyOfTwo(others_at=12)
    _sync_worker_of(ps)._pull(everything=True)
    assert ps.filled_at == 12


def test_a_new_worker_that_finds_a_ps_empty_fills_it_at_the_version_the_others_are_at():
    """Found by the simulator (seed 3046, sync, 2 PS, 1 worker): a PS relaunched without a
    checkpoint while no worker was left was filled by the replacement worker's first pull
    (``_initialize_ps``) at version 0, 6 versions behind the other shard for good."""
    ps = _OneEmptyOfTwo(others_at=6)
    _sync_worker_of(ps)._initialize_ps()
    assert ps.filled_at == 6


def test_a_worker_waiting_for_a_task_refills_a_ps_that_holds_no_model(monkeypatch):
    """Found by the simulator (seed 1475, sync, 3 PS, no checkpoint): a PS killed once every task
    was done came back empty; no batch was left to pull for it, and the job ended with its shard
    missing. A waiting worker looks (every REFILL_PROBE_SECONDS) and refills it; a sync job's
    leveling waits for that (tests/test_ps_leveling.py)."""
    from elasticdl.worker import batch_loop

    now = [100.0]
    monkeypatch.setattr(batch_loop.time, "monotonic", lambda: now[0])
    ps = _OneEmptyOfTwo(others_at=6)
    worker = _sync_worker_of(ps)
    versions = worker.consistency.versions
    worker._refill_while_waiting()
    assert ps.pulls == 0  # not before it waited REFILL_PROBE_SECONDS since it started
    now[0] += batch_loop.REFILL_PROBE_SECONDS
    worker._refill_while_waiting()
    assert ps.filled_at == 6 and worker.consistency.versions == versions  # the policy is not told
    worker._refill_while_waiting()
    assert ps.pulls == 1  # not again before REFILL_PROBE_SECONDS
    now[0] += batch_loop.REFILL_PROBE_SECONDS
    worker._refill_while_waiting()
    assert ps.pulls == 2
