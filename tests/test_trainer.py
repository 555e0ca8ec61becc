"""Trainer: one trace for every batch size, parameters set straight into the variables."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from elasticdl.model.spec import ModelSpecError, load_model_spec
from elasticdl.model.trainer import Trainer


@pytest.fixture()
def trainer(repo_root) -> Trainer:
    spec = load_model_spec(str(repo_root / "model_zoo"), "digits.digits_functional.custom_model")
    return Trainer(spec, {})


@pytest.fixture()
def repo_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[1]


def _batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.random((n, 64), np.float32)), tf.constant(rng.integers(0, 10, (n, 1)))


def test_an_epochs_last_smaller_batch_does_not_trace_the_step_again(trainer):
    features, labels = _batch(32)
    trainer.ensure_built(features)
    trainer.compute_gradients(features, labels)
    trainer.compute_gradients(*_batch(7, seed=1))  # the last batch of an epoch
    trainer.compute_gradients(features, labels)
    assert trainer._train_step.experimental_get_tracing_count() == 1


def test_gradients_match_keras_whatever_the_batch_size(trainer):
    features, labels = _batch(7, seed=2)
    trainer.ensure_built(features)
    trainer.compute_gradients(*_batch(32))
    loss, grads = trainer.compute_gradients(features, labels)
    with tf.GradientTape() as tape:
        expected_loss = trainer.spec.loss(labels, trainer.model(features, training=True))
    expected = tape.gradient(expected_loss, list(trainer.variables.values()))
    assert loss == pytest.approx(float(expected_loss), rel=1e-5)
    for name, value in zip(trainer.variables, expected):
        np.testing.assert_allclose(grads[name], value.numpy(), rtol=1e-5, atol=1e-7)


def test_set_params_writes_the_keras_variables_and_checks_shapes(trainer):
    trainer.ensure_built(_batch(4)[0])
    params = {name: np.full(var.shape, 0.5, np.float32) for name, var in trainer.variables.items()}
    trainer.set_params(params)
    for name, var in trainer.variables.items():
        np.testing.assert_array_equal(var.numpy(), params[name])
    name = next(iter(params))
    with pytest.raises(ModelSpecError, match=f"holds '{name}' with shape \\(3,\\)"):
        trainer.set_params({name: np.zeros(3, np.float32)})
    with pytest.raises(ModelSpecError, match="which this model does not have"):
        trainer.set_params({"no/such/variable": np.zeros(3, np.float32)})
