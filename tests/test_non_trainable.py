"""Non-trainable variables on the PS: how pushed changes combine (sync: the average of the
workers' new values; async: each added as it comes), and that snapshots, checkpoints and a
restored PS carry them. The trainer's side: the changes a step sends are Keras's own update."""

from __future__ import annotations

import os

import numpy as np
import pytest

from elasticdl.model import checkpoint
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.model.sharding import ps_for_variable
from elasticdl.ps.parameters import GradientError
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc.push_outcome import PushOutcome

LR = 0.1
MEAN, VAR = "bn/moving_mean", "bn/moving_variance"
START = {"dense/kernel": np.ones((2, 2), np.float32), MEAN: np.zeros(2, np.float32), VAR: np.ones(2, np.float32)}


def make_ps(optimizer: str = "SGD", **settings) -> ParameterServer:
    ps = ParameterServer(PSSettings(**settings), make_optimizer(OptimizerSpec(optimizer, {"learning_rate": LR})))
    assert ps.push_model(START, non_trainable=[MEAN, VAR]) == (True, 0)
    return ps


def push(ps: ParameterServer, version: int, grad: float, new_mean=None, new_var=None):
    """One worker's step computed on ``version``: its gradient, and its new moving statistics
    sent as the change from the values it computed on (``held``)."""
    held = ps.pull(-1)[2]
    grads = {"dense/kernel": np.full((2, 2), grad, np.float32)}
    for name, new in ((MEAN, new_mean), (VAR, new_var)):
        if new is not None:
            grads[name] = NonTrainableChange(np.asarray(new, np.float32) - held[name])
    return ps.push_gradients(grads, version, None)


def test_sync_sets_the_average_of_the_workers_new_values():
    ps = make_ps(grads_to_wait=2)
    first = push(ps, 0, 1.0, new_mean=[10.0, 20.0], new_var=[4.0, 9.0])
    assert first.outcome == PushOutcome.ACCEPTED_PENDING
    np.testing.assert_array_equal(ps.shard.params[MEAN], [0, 0])  # nothing moves before the version
    second = push(ps, 0, 3.0, new_mean=[30.0, 40.0], new_var=[6.0, 1.0])
    assert second.applied and second.version == 1
    np.testing.assert_allclose(ps.shard.params[MEAN], [20.0, 30.0])
    np.testing.assert_allclose(ps.shard.params[VAR], [5.0, 5.0])
    np.testing.assert_allclose(ps.shard.params["dense/kernel"], 1 - LR * 2.0)  # the gradients' average
    # A push that leaves a statistic out did not change it: its new value is the old one.
    push(ps, 1, 1.0, new_mean=[40.0, 50.0])
    push(ps, 1, 1.0)
    np.testing.assert_allclose(ps.shard.params[MEAN], [30.0, 40.0])
    np.testing.assert_allclose(ps.shard.params[VAR], [5.0, 5.0])


def test_sync_with_fewer_live_workers_averages_the_pushes_it_has():
    ps = make_ps(grads_to_wait=3)
    push(ps, 0, 1.0, new_mean=[6.0, 6.0])
    push(ps, 0, 1.0, new_mean=[2.0, 4.0])
    ps.set_live_workers(2)  # the third worker left: the version is made of two pushes
    assert ps.shard.version == 1
    np.testing.assert_allclose(ps.shard.params[MEAN], [4.0, 5.0])


def test_async_adds_each_change_as_it_comes():
    ps = make_ps(use_async=True)
    held = ps.pull(-1)[2]  # both workers computed on version 0
    a = {"dense/kernel": np.zeros((2, 2), np.float32), MEAN: NonTrainableChange(np.array([1.0, 2.0], np.float32))}
    b = {"dense/kernel": np.zeros((2, 2), np.float32), MEAN: NonTrainableChange(np.array([10.0, 20.0], np.float32))}
    assert ps.push_gradients(a, 0, None).applied
    assert ps.push_gradients(b, 0, None).applied  # one version stale: added all the same, not replacing a's
    np.testing.assert_allclose(ps.shard.params[MEAN], held[MEAN] + [11.0, 22.0])
    np.testing.assert_array_equal(ps.shard.params[VAR], [1, 1])


def test_no_optimizer_touches_them_and_gradients_for_them_are_refused():
    ps = make_ps("Adam")
    assert set(ps.shard.slots) == {"dense/kernel"}
    result = ps.push_gradients({"dense/kernel": np.ones((2, 2), np.float32), MEAN: np.ones(2, np.float32)}, 0, None)
    assert result.outcome == PushOutcome.REJECTED_INVALID and "non-trainable" in result.reason
    with pytest.raises(GradientError, match="which is trainable"):
        ps.shard.check_gradients({"dense/kernel": NonTrainableChange(np.ones((2, 2), np.float32))})
    assert ps.shard.version == 0


def test_a_ps_holding_only_statistics_takes_pushes_without_gradients():
    """Placed by name hash, a PS may hold a BatchNorm's statistics and no trainable variable."""
    ps = ParameterServer(PSSettings(use_async=True), make_optimizer(OptimizerSpec("SGD", {"learning_rate": LR})))
    ps.push_model({MEAN: np.zeros(2, np.float32)}, non_trainable=[MEAN])
    assert ps.push_gradients({MEAN: NonTrainableChange(np.ones(2, np.float32))}, 0, None).applied
    assert ps.push_gradients({}, 1, None).applied  # a batch that left it unchanged
    np.testing.assert_array_equal(ps.shard.params[MEAN], [1, 1])


def test_snapshots_and_checkpoints_carry_them_and_a_restored_ps_keeps_training_them(tmp_path):
    ps = make_ps("Adam", use_async=True, checkpoint_dir=str(tmp_path), checkpoint_steps=1)
    push(ps, 0, 1.0, new_mean=[3.0, 4.0], new_var=[2.0, 2.0])
    ps.take_snapshot(1)
    push(ps, 1, 1.0, new_mean=[5.0, 6.0])
    np.testing.assert_allclose(ps.pull_snapshot(1)[2][MEAN], [3.0, 4.0])  # evaluation sees version 1's

    restored = ParameterServer(PSSettings(checkpoint_dir_for_init=str(tmp_path), use_async=True),
                               make_optimizer(OptimizerSpec("Adam", {"learning_rate": LR})))
    restored.restore()
    assert restored.shard.version == 2 and restored.shard.non_trainable == {MEAN, VAR}
    for name in START:
        np.testing.assert_array_equal(restored.shard.params[name], ps.shard.params[name])
    assert set(restored.shard.slots) == {"dense/kernel"}
    push(restored, 2, 1.0, new_mean=[7.0, 8.0])
    np.testing.assert_allclose(restored.shard.params[MEAN], [7.0, 8.0])

    # On two PS, each statistic goes to the PS its name hashes to, as a trainable variable would.
    for ps_id in range(2):
        state = checkpoint.load_shard(str(tmp_path), ps_id, 2)
        assert set(state.non_trainable) == {n for n in (MEAN, VAR) if ps_for_variable(n, 2) == ps_id}
        assert not set(state.params) & {MEAN, VAR}
    assert os.path.isfile(tmp_path / "version-2" / "ps-0-of-1.npz")


# ---------------------------------------------------------------- the trainer


@pytest.fixture()
def trainer():
    from elasticdl.model.spec import load_model_spec
    from elasticdl.model.trainer import Trainer

    zoo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")
    return Trainer(load_model_spec(zoo, "bnzoo.digits_bn.custom_model"), {})


def test_a_step_sends_keras_own_update_and_leaves_the_statistics_to_the_ps(trainer):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    features = tf.constant(rng.uniform(0, 255, (16, 64)).astype(np.float32))
    labels = tf.constant(rng.integers(0, 10, (16, 1)))
    trainer.ensure_built(features)
    assert set(trainer.non_trainable) == {"bn/moving_mean", "bn/moving_variance"}
    assert set(trainer.get_params()) == {*trainer.variables, *trainer.non_trainable}
    before = {n: v.numpy() for n, v in trainer.non_trainable.items()}
    _, grads = trainer.compute_gradients(features, labels)
    for name, value in before.items():  # the step left them as they were
        np.testing.assert_array_equal(trainer.non_trainable[name].numpy(), value)
    hidden = features.numpy() @ trainer.variables["hidden/kernel"].numpy()
    np.testing.assert_allclose(grads["bn/moving_mean"].values, 0.1 * hidden.mean(axis=0), rtol=1e-3)
    np.testing.assert_allclose(grads["bn/moving_variance"].values, 0.1 * (hidden.var(axis=0) - 1), rtol=1e-3)
    # Async with --get_model_steps > 1: the worker trains on its own change until it pulls.
    trainer.apply_locally(grads, None)
    np.testing.assert_allclose(trainer.non_trainable["bn/moving_mean"].numpy(), 0.1 * hidden.mean(axis=0), rtol=1e-3)


def test_integer_state_stays_with_each_worker():
    """Dropout's seed counter: workers that shared it would draw the same masks."""
    import keras

    from elasticdl.model.non_trainable import lives_on_ps

    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dropout(0.5)])
    assert sorted(v.name for v in model.non_trainable_variables if lives_on_ps(v)) == ["moving_mean", "moving_variance"]
    assert any(not lives_on_ps(v) for v in model.non_trainable_variables)
