"""The PS's checks of a dense gradient from one sum of squares (elasticdl/ps/square_sums.py):
the same answers as the value-by-value checks they replace, for every kind of extreme value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.gradient_guard import FLOAT32_SQUARE_LIMIT, GradientGuard
from elasticdl.ps.parameters import GradientError, ParameterShard
from elasticdl.ps.square_sums import SAFE_SQUARE_SUM, cleared_square_sum, square_sum

SHAPES = {"a/kernel": (64, 32), "a/bias": (32,), "b/kernel": (32, 8)}


def test_a_finite_gradient_is_cleared_with_its_sum_of_squares():
    grad = np.arange(-5, 5, dtype=np.float32)
    assert cleared_square_sum(grad) == pytest.approx(float((grad.astype(np.float64) ** 2).sum()))
    assert cleared_square_sum(np.zeros((0, 3), np.float32)) == 0.0


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 2e19, -1.5e19, math.sqrt(SAFE_SQUARE_SUM) * 1.01])
def test_a_gradient_the_sum_cannot_clear_is_left_to_the_exact_checks(value):
    grad = np.ones(1000, np.float32)
    grad[517] = value
    assert cleared_square_sum(grad) is None


def reference(grads: dict[str, np.ndarray]) -> str:
    """What the checks answered when they looked at every value (before square_sums)."""
    for grad in grads.values():
        if not np.isfinite(grad).all():
            return "invalid"
    largest = max(float(np.max(np.abs(g))) for g in grads.values())
    with np.errstate(over="ignore"):
        norm = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads.values()))
    if not math.isfinite(norm) or largest > FLOAT32_SQUARE_LIMIT:
        return "refused"
    return "applied"


def checked(grads: dict[str, np.ndarray]) -> str:
    shard = ParameterShard(make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})))
    shard.initialize({name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()})
    try:
        shard.check_gradients(grads)
    except GradientError as err:
        assert "contains NaN or Inf" in str(err)
        return "invalid"
    return "refused" if GradientGuard(max_norm_ratio=0).problem(grads) else "applied"


EXTREMES = [np.nan, np.inf, -np.inf, 1e19, 1.5e19, 1.8e19, FLOAT32_SQUARE_LIMIT * 1.001, 3e19, 1e30, 3e38, 1e-30]


@pytest.mark.parametrize("seed", range(40))
def test_the_checks_answer_as_the_value_by_value_ones(seed):
    rng = np.random.default_rng(seed)
    grads = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    for _ in range(rng.integers(0, 4)):  # a few extreme values, anywhere
        name = list(SHAPES)[rng.integers(len(SHAPES))]
        flat = grads[name].reshape(-1)
        flat[rng.integers(flat.size)] = EXTREMES[rng.integers(len(EXTREMES))] * rng.choice([-1, 1])
    assert checked(grads) == reference(grads)


def test_values_just_under_the_float32_square_limit_still_pass_and_their_norm_is_exact():
    grads = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    grads["a/bias"][3] = 1.5e19  # its square (2.25e38) is finite, above what the sum clears
    assert checked(grads) == "applied"
    guard = GradientGuard(max_norm_ratio=0)
    guard.problem(grads)
    assert guard._measured == pytest.approx(1.5e19, rel=1e-6)
    assert square_sum(grads["a/bias"]) == pytest.approx(2.25e38, rel=1e-6)
