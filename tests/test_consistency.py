"""Sync, async and stale-synchronous training: strategies, clocks, and numerical equivalence."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticdl.config import ConfigError, JobConfig
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.telemetry import StalenessSummary, summarize
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.worker.consistency import ConsistencyPolicy

SGD = OptimizerSpec("SGD", {"learning_rate": 0.5})


def make_ps(**settings) -> ParameterServer:
    ps = ParameterServer(PSSettings(**settings), make_optimizer(SGD))
    ps.push_model({"w": np.zeros(3, np.float32)})
    return ps


def grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32)}


# ---------------------------------------------------------------- PS strategies


def test_sync_averages_grads_to_wait_gradients_of_one_version():
    ps = make_ps(grads_to_wait=2)
    first = ps.push_gradients(grad(1.0), 0, None)
    assert first.accepted and not first.applied and ps.shard.version == 0
    second = ps.push_gradients(grad(3.0), 0, None)
    assert second.accepted and second.applied and ps.shard.version == 1
    np.testing.assert_allclose(ps.shard.params["w"], -0.5 * 2.0)  # lr * mean(1, 3)


def test_sync_tolerance_accepts_recent_versions_and_rejects_older():
    ps = make_ps(grads_to_wait=1, sync_version_tolerance=1)
    assert ps.push_gradients(grad(1.0), 0, None).applied  # version 0 -> 1
    assert ps.push_gradients(grad(1.0), 0, None).accepted  # 1 behind: within tolerance
    stale = ps.push_gradients(grad(1.0), 0, None)  # 2 behind
    assert not stale.accepted and "stale" in stale.reason
    _, telemetry, _ = ps.stats()
    assert telemetry.pushes_rejected_stale == 1
    assert dict(telemetry.staleness) == {0: 1, 1: 1}


def test_lr_staleness_modulation_divides_the_step_by_staleness():
    ps = make_ps(use_async=True, lr_staleness_modulation=True)
    ps.push_gradients(grad(1.0), 0, None)  # staleness 0: full step 0.5
    ps.push_gradients(grad(1.0), 0, None)  # staleness 1: full step
    ps.push_gradients(grad(1.0), 0, None)  # staleness 2: half step
    np.testing.assert_allclose(ps.shard.params["w"], -(0.5 + 0.5 + 0.25))


def test_sync_adapts_grads_to_wait_to_live_workers_and_back():
    ps = make_ps(grads_to_wait=3, minibatch_size=32)
    ps.push_gradients(grad(1.0), 0, None)
    ps.push_gradients(grad(2.0), 0, None)
    assert ps.shard.version == 0
    ps.set_live_workers(2)  # a worker left: the two pending gradients are enough now
    assert ps.shard.version == 1
    np.testing.assert_allclose(ps.shard.params["w"], -0.5 * 1.5)
    ps.set_live_workers(5)  # capped at the configured 3
    assert ps.stats()[2] == 3


def test_pull_waits_for_a_newer_version_in_sync_mode():
    ps = make_ps(grads_to_wait=2)
    ps.push_gradients(grad(1.0), 0, None)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(v=ps.pull(0, wait_for_newer=True, timeout=10)[1]))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # blocked: the version has not moved
    ps.push_gradients(grad(1.0), 0, None)
    waiter.join(5)
    assert result["v"] == 1


@settings(max_examples=60, deadline=None)
@given(
    grads_to_wait=st.integers(1, 4),
    events=st.lists(st.tuples(st.sampled_from(["push", "stale", "live"]), st.integers(0, 5)), max_size=60),
)
def test_sync_versions_strictly_increase_and_never_stall(grads_to_wait, events):
    ps = make_ps(grads_to_wait=grads_to_wait)
    versions = [0]
    live = grads_to_wait
    for kind, arg in events:
        if kind == "push":
            ps.push_gradients(grad(1.0), ps.shard.version, None)
        elif kind == "stale" and ps.shard.version > 0:
            assert not ps.push_gradients(grad(1.0), ps.shard.version - 1, None).accepted
        elif kind == "live":
            live = max(1, arg)
            ps.set_live_workers(live)
        if ps.shard.version != versions[-1]:
            assert ps.shard.version == versions[-1] + 1
            versions.append(ps.shard.version)
    # No deadlock: the live workers each pushing once always produces a new version.
    before = ps.shard.version
    for _ in range(min(live, grads_to_wait)):
        ps.push_gradients(grad(1.0), ps.shard.version, None)
    assert ps.shard.version == before + 1


# ---------------------------------------------------------------- SSP clocks


@settings(max_examples=80, deadline=None)
@given(
    bound=st.integers(1, 3),
    events=st.lists(st.tuples(st.sampled_from(["step", "leave", "join"]), st.integers(0, 3)), max_size=120),
)
def test_ssp_bound_holds_and_leaving_workers_never_block(bound, events):
    """Random interleavings of 4 workers stepping, leaving and (re)joining."""
    policy = ConsistencyPolicy(use_async=True, staleness_bound=bound)
    clocks = WorkerClocks()
    ps = make_ps(use_async=True)
    raw = {w: 0 for w in range(4)}
    active = {0, 1, 2, 3}
    last_version = 0
    for kind, w in events:
        if kind == "leave":
            active.discard(w)
            continue
        if kind == "join":
            active.add(w)
            continue
        if w not in active:
            continue
        view = clocks.report(w, raw[w], set(active))
        if policy.must_wait(view.clock, view.slowest):
            continue  # blocked this turn
        # It may start a batch: it is at most `bound` ahead of every worker holding a task.
        assert view.clock - view.slowest <= bound
        raw[w] += 1
        ps.push_gradients(grad(0.01), ps.shard.version, None)
        assert ps.shard.version == last_version + 1
        last_version = ps.shard.version
    if active:
        # No deadlock: some worker holding a task can always go (the slowest one).
        views = {w: clocks.report(w, raw[w], set(active)) for w in sorted(active)}
        assert any(not policy.must_wait(v.clock, v.slowest) for v in views.values())


def test_a_joining_worker_starts_at_the_slowest_clock():
    clocks = WorkerClocks()
    clocks.report(0, 0, {0, 1})
    clocks.report(1, 0, {0, 1})
    clocks.report(0, 50, {0, 1})
    clocks.report(1, 48, {0, 1})
    view = clocks.report(2, 0, {0, 1, 2})
    assert view.clock == 48 and view.slowest == 48


def _after_pushes(policy: ConsistencyPolicy, steps: int) -> ConsistencyPolicy:
    for _ in range(steps):
        policy.batch_pushed()
    return policy


def test_consistency_policy_pull_rules():
    sync = ConsistencyPolicy()
    assert sync.must_pull() and sync.waits_for_version and not sync.bounded
    lazy = [_after_pushes(ConsistencyPolicy(use_async=True, get_model_steps=3), n) for n in range(4)]
    assert [p.must_pull() for p in lazy] == [False, False, False, True]
    assert lazy[0].applies_locally and not lazy[0].waits_for_version


def test_telemetry_summary_per_epoch():
    class Stats:
        def __init__(self, accepted, stale, hist, records):
            self.pushes_accepted, self.pushes_rejected_stale = accepted, stale
            self.pushes_rejected_invalid, self.staleness, self.records_applied = 0, hist, records

    start = summarize([Stats(10, 2, {0: 8, 1: 2}, 320)], 1.0)
    end = summarize([Stats(30, 2, {0: 20, 1: 6, 3: 4}, 2880)], 3.5)
    epoch = end.minus(start)
    assert (epoch.pushes_accepted, epoch.pushes_rejected_stale) == (20, 0)
    assert epoch.staleness == {0: 12, 1: 4, 3: 4}
    assert epoch.blocked_seconds == pytest.approx(2.5)
    assert epoch.mean_staleness == pytest.approx((4 + 12) / 20)
    assert "rejected as stale 0 (0.0%)" in epoch.describe()
    assert epoch.records_per_push == 128.0 and "records per push 128.0" in epoch.describe()
    assert StalenessSummary().to_dict()["rejected_stale_rate"] == 0.0


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"staleness_bound": 2}, ["--staleness_bound=2", "--use_async"]),
        ({"get_model_steps": 4}, ["--get_model_steps=4", "--use_async"]),
        ({"push_steps": 4}, ["--push_steps=4", "--use_async"]),
        ({"use_async": True, "push_steps": 0}, ["--push_steps"]),
        ({"overlap_communication": True}, ["--overlap_communication", "--use_async"]),
        ({"use_async": True, "overlap_communication": True, "push_steps": 4},
         ["--overlap_communication", "--push_steps=4", "drop one"]),
        ({"use_async": True, "grads_to_wait": 2}, ["--grads_to_wait=2", "--use_async"]),
        ({"use_async": True, "sync_version_tolerance": 1}, ["--sync_version_tolerance=1", "--use_async"]),
        ({"lr_staleness_modulation": True}, ["--lr_staleness_modulation", "--sync_version_tolerance"]),
        ({"grads_to_wait": -1}, ["--grads_to_wait"]),
        ({"use_async": True, "staleness_bound": -1}, ["--staleness_bound"]),
    ],
)
def test_conflicting_consistency_flags_are_rejected(tmp_path, flags, words):
    with pytest.raises(ConfigError) as err:  # a flag out of its range: already where flags enter
        JobConfig.from_flags(model_zoo=str(tmp_path), model_def="a.b.c", training_data="x", **flags).validate()
    for word in words:
        assert word in str(err.value)


# ---------------------------------------------------------------- numerical equivalence


def test_sync_training_equals_single_process_averaged_gradients(tmp_path):
    """2 workers, grads_to_wait=2, over real gRPC, vs. Keras applying the averaged gradient."""
    import os

    import keras
    import tensorflow as tf

    from elasticdl.model.optimizers import optimizer_spec_from_keras
    from elasticdl.model.spec import load_model_spec
    from elasticdl.model.trainer import Trainer
    from elasticdl.ps.servicer import PServerServicer
    from elasticdl.rpc.channel import add_service, bind_local, make_server
    from elasticdl.rpc.ps_client import PSClient
    from elasticdl.worker.worker import Worker

    zoo = os.path.join(os.path.dirname(os.path.dirname(__file__)), "model_zoo")
    spec = load_model_spec(zoo, "digits.digits_functional.custom_model")
    rng = np.random.default_rng(0)
    steps, batch = 4, 16
    data = [
        [(rng.random((batch, 64), dtype=np.float32), rng.integers(0, 10, (batch, 1))) for _ in range(steps)]
        for _ in range(2)
    ]

    core = ParameterServer(PSSettings(grads_to_wait=2), make_optimizer(optimizer_spec_from_keras(spec.optimizer())))
    server = make_server()
    add_service(server, "PServer", PServerServicer(core))
    address = f"127.0.0.1:{bind_local(server)}"
    server.start()
    try:
        workers = [
            Worker(i, spec, Trainer(spec, {}), master=None, ps=PSClient([address]), minibatch_size=batch)
            for i in range(2)
        ]
        # Worker 0 initialises the PS; worker 1 then starts from the same parameters.
        workers[0].trainer.ensure_built(data[0][0][0])
        workers[0]._initialize_ps()
        initial = dict(core.shard.params)
        initial = {k: v.copy() for k, v in initial.items()}

        def run(worker, batches):
            for features, labels in batches:
                worker.train_batch(tf.constant(features), tf.constant(labels))

        threads = [threading.Thread(target=run, args=(w, d)) for w, d in zip(workers, data)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert core.shard.version == steps
        distributed = {k: v.copy() for k, v in core.shard.params.items()}
    finally:
        server.stop(0)

    # Single process: the same model, the averaged gradient of the same two batches per step.
    reference = Trainer(spec, {})
    reference.ensure_built(data[0][0][0])
    reference.set_params(initial)
    optimizer = spec.optimizer()
    names = list(reference.variables)
    for step in range(steps):
        grads = [reference.compute_gradients(tf.constant(f), tf.constant(lab))[1] for f, lab in
                 (data[0][step], data[1][step])]
        averaged = [(tf.constant((grads[0][n] + grads[1][n]) / 2), reference.variables[n]) for n in names]
        optimizer.apply_gradients(averaged)
    for name in names:
        np.testing.assert_allclose(distributed[name], reference.variables[name].numpy(), atol=1e-5)
    assert isinstance(optimizer, keras.optimizers.SGD)
