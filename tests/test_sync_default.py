"""Issue 29, "a default that wastes nothing": by default a sync version waits for one gradient
from each worker holding a training task (grads_to_wait 0), the master tells the PS of an idle
worker at once when no task is left to hand out, and the telemetry's line says what stale
refusals cost and which flag changes them (docs/consistency.md)."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.config import ConfigError, JobConfig
from elasticdl.master import controller as c
from elasticdl.master.task_manager import TaskType
from elasticdl.master.telemetry import StalenessSummary
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.main import settings_from_config
from elasticdl.ps.server import ParameterServer
from elasticdl.ps.strategies import AverageUpdatingStrategy
from tests.test_controller import make, of, report, take

SGD = OptimizerSpec("SGD", {"learning_rate": 0.5})


def config(**flags) -> JobConfig:
    cfg = JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="x", **flags)
    cfg.validate(check_paths=False)
    return cfg


def ps_of(cfg: JobConfig) -> ParameterServer:
    ps = ParameterServer(settings_from_config(cfg, 0), make_optimizer(SGD))
    ps.push_model({"w": np.zeros(3, np.float32)})
    return ps


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32)}


# ---------------------------------------------------------------- the PS rule


@pytest.mark.parametrize("workers", [2, 3])
def test_default_sync_takes_every_workers_gradient_of_a_version_instead_of_refusing_it(workers):
    """Workers that pulled the same version all push it: with the former default (one gradient
    per version) all but the first were refused as stale, computations thrown away."""
    ps = ps_of(config())
    ps.set_live_workers(workers)  # the master's count (a rise is told at once)
    outcomes = [ps.push_gradients(grad(float(w + 1)), 0, None) for w in range(workers)]
    assert all(o.accepted for o in outcomes)
    assert [o.applied for o in outcomes] == [False] * (workers - 1) + [True]
    assert ps.shard.version == 1
    np.testing.assert_allclose(ps.shard.params["w"], -0.5 * np.mean(range(1, workers + 1)))
    _, telemetry, grads_to_wait = ps.stats()
    assert telemetry.pushes_rejected_stale == 0 and grads_to_wait == workers


def test_a_fixed_grads_to_wait_of_1_still_refuses_the_others_as_before():
    ps = ps_of(config(grads_to_wait=1))
    ps.set_live_workers(2)
    assert ps.push_gradients(grad(1.0), 0, None).applied
    assert not ps.push_gradients(grad(1.0), 0, None).accepted  # computed for nothing


def test_following_the_live_workers_has_no_cap_and_applies_what_waits_when_they_drop():
    strategy = ps_of(config()).strategy
    assert isinstance(strategy, AverageUpdatingStrategy) and strategy.follows_live_workers
    assert strategy.grads_to_wait == 1  # before the master's first count: nobody waits
    ps = ps_of(config())
    ps.set_live_workers(5)  # scaled up beyond --num_workers: still one per worker
    assert ps.stats()[2] == 5
    for _ in range(3):
        ps.push_gradients(grad(1.0), 0, None)
    assert ps.shard.version == 0
    ps.set_live_workers(3)  # two left: the three pending gradients make the version
    assert ps.shard.version == 1 and ps.stats()[2] == 3
    ps.set_live_workers(0)
    assert ps.stats()[2] == 1  # never 0: a version always closes


# ---------------------------------------------------------------- the master's count


def test_an_idle_worker_is_told_at_once_when_no_task_is_left_to_hand_out():
    """At an epoch's end one worker holds the last task while the other has none to take: the
    PS must not hold the last worker's pushes for the idle one's gradient (the settle delay,
    1 s per epoch, would cost small jobs a third of their time)."""
    ctl, dispatcher, _, clock = make(workers=2, sync=True, tasks=3, epochs=2)
    ctl.start()
    started = clock.now
    first, second = take(dispatcher, 0), take(dispatcher, 1)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(2)]
    report(ctl, dispatcher, first, 0)  # a task is left: worker 0 is between two tasks
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []
    take(dispatcher, 0)  # the epoch's last task
    # Worker 1 reports with nothing left to take: told at once, no settle delay on the clock.
    assert of(report(ctl, dispatcher, second, 1), c.TellLiveWorkers) == [c.TellLiveWorkers(1)]
    assert clock.now == started


def test_a_worker_evaluating_is_not_waited_for():
    """An evaluation task pushes no gradient: counted live, it held a version open until the
    round ended."""
    ctl, dispatcher, ps, _ = make(workers=2, sync=True, epochs=2, tasks=2, evaluation_steps=5, with_eval=True)
    ctl.start()
    take(dispatcher, 0)
    ps.version = 5
    told = of(ctl.step(c.VersionReported(5)), c.TellLiveWorkers)  # a round starts
    assert take(dispatcher, 1).type == TaskType.EVALUATION  # and takes the other worker
    told += of(ctl.step(c.Tick()), c.TellLiveWorkers)
    assert told == [c.TellLiveWorkers(1)]


# ---------------------------------------------------------------- flags and the log line


def test_grads_to_wait_0_is_the_default_and_negative_is_refused():
    cfg = config()
    assert cfg.consistency.grads_to_wait == 0
    assert cfg.consistency.description == "sync SGD, grads_to_wait=one per worker holding a task"
    config(use_async=True)  # the default is no conflict with async
    with pytest.raises(ConfigError, match="--grads_to_wait"):
        config(grads_to_wait=-1)


@pytest.mark.parametrize(
    "flags, names",
    [
        ({}, "--sync_version_tolerance 1"),
        ({"grads_to_wait": 1}, "--grads_to_wait 0"),
        ({"sync_version_tolerance": 2}, "--sync_version_tolerance=2"),
        ({"use_async": True}, "no flag changes that"),
    ],
)
def test_the_consistency_line_says_what_stale_pushes_cost_and_which_flag_changes_it(flags, names):
    summary = StalenessSummary(pushes_accepted=90, pushes_rejected_stale=10, staleness={0: 90})
    line = summary.describe(config(**flags).consistency.stale_remedy)
    assert "rejected as stale 10 (10.0%)" in line
    assert "10.0% of the gradient computations wasted" in line and names in line
    assert summary.noteworthy  # above 5%: an epoch's line at INFO, not hidden at DEBUG
    clean = StalenessSummary(pushes_accepted=100, staleness={0: 100})
    assert "wasted" not in clean.describe("--x") and not clean.noteworthy
    assert not StalenessSummary(pushes_accepted=96, pushes_rejected_stale=4).noteworthy
