"""The PS's numpy optimizers must track Keras 3's own optimizers step for step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest

from elasticdl.model.optimizers import (
    OptimizerSpec,
    UnsupportedOptimizerError,
    make_optimizer,
    optimizer_spec_from_keras,
)

SHAPES = [(4, 3), (5,)]
STEPS = 10
TOL = {"atol": 1e-5, "rtol": 1e-5}

opts = keras.optimizers
CONFIGS = {
    "sgd": lambda: opts.SGD(learning_rate=0.1),
    "sgd_momentum": lambda: opts.SGD(learning_rate=0.05, momentum=0.9),
    "sgd_nesterov": lambda: opts.SGD(learning_rate=0.05, momentum=0.8, nesterov=True),
    "adam": lambda: opts.Adam(learning_rate=0.01),
    "adam_amsgrad": lambda: opts.Adam(learning_rate=0.01, beta_1=0.8, amsgrad=True),
    "adagrad": lambda: opts.Adagrad(learning_rate=0.1),
    "adagrad_custom": lambda: opts.Adagrad(
        learning_rate=0.05, initial_accumulator_value=0.5, epsilon=1e-3
    ),
    "rmsprop": lambda: opts.RMSprop(learning_rate=0.01),
    "rmsprop_momentum": lambda: opts.RMSprop(learning_rate=0.01, rho=0.8, momentum=0.5),
    "rmsprop_centered": lambda: opts.RMSprop(learning_rate=0.01, centered=True),
    "rmsprop_centered_momentum": lambda: opts.RMSprop(
        learning_rate=0.005, momentum=0.9, centered=True, epsilon=1e-4
    ),
    "sgd_weight_decay": lambda: opts.SGD(learning_rate=0.1, weight_decay=0.05),
    "adam_weight_decay": lambda: opts.Adam(learning_rate=0.01, weight_decay=0.1),
    "adamw": lambda: opts.AdamW(learning_rate=0.01),
    "sgd_clipnorm": lambda: opts.SGD(learning_rate=0.1, clipnorm=0.5),
    "adam_clipnorm_loose": lambda: opts.Adam(learning_rate=0.01, clipnorm=100.0),
    "rmsprop_clipvalue": lambda: opts.RMSprop(learning_rate=0.01, clipvalue=0.3),
    "adagrad_clipvalue_wd": lambda: opts.Adagrad(
        learning_rate=0.1, clipvalue=0.5, weight_decay=0.01
    ),
}


def _run_both(make_keras, lrs=None, seed=0):
    """Apply the same random gradients through Keras and through ours."""
    rng = np.random.default_rng(seed)
    inits = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = [
        [rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(STEPS)
    ]

    kopt = make_keras()
    kvars = [keras.Variable(x.copy()) for x in inits]
    spec = optimizer_spec_from_keras(kopt)
    ours = make_optimizer(
        OptimizerSpec.from_json_dict(json.loads(json.dumps(spec.to_json_dict())))
    )
    params = [x.copy() for x in inits]
    slots = [ours.create_slots(p) for p in params]

    for step, gs in enumerate(grads, start=1):
        lr = None if lrs is None else lrs[step - 1]
        if lr is not None:
            kopt.learning_rate.assign(lr)
        kopt.apply_gradients(zip(gs, kvars))
        for p, g, s in zip(params, gs, slots):
            ours.apply(p, g, s, step, learning_rate=lr)
    return [np.asarray(v.numpy()) for v in kvars], params, inits


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_keras(config):
    expected, actual, inits = _run_both(CONFIGS[config])
    for e, a, x in zip(expected, actual, inits):
        assert not np.allclose(a, x)  # the test is vacuous if nothing moved
        np.testing.assert_allclose(a, e, **TOL)


@pytest.mark.parametrize(
    "config", ["sgd_momentum", "adam_weight_decay", "adagrad", "rmsprop_centered"]
)
def test_learning_rate_override_matches_keras(config):
    lrs = [0.02 * (0.8**i) for i in range(STEPS)]
    expected, actual, _ = _run_both(CONFIGS[config], lrs=lrs, seed=1)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, **TOL)


def test_spec_contents_and_defaults():
    spec = optimizer_spec_from_keras(opts.SGD(learning_rate=0.1, momentum=0.9))
    assert spec.name == "SGD"
    assert spec.config["momentum"] == 0.9
    opt = make_optimizer(spec)
    assert opt.learning_rate == pytest.approx(0.1)
    assert opt.slot_names == ("momentum",)
    assert make_optimizer(OptimizerSpec("SGD", {})).slot_names == ()
    assert optimizer_spec_from_keras(opts.AdamW()).name == "Adam"

    slots = make_optimizer(
        OptimizerSpec("Adagrad", {"initial_accumulator_value": 0.3})
    ).create_slots(np.zeros((2, 3), np.float32))
    assert slots["accumulator"].dtype == np.float32
    np.testing.assert_array_equal(
        slots["accumulator"], np.full((2, 3), 0.3, np.float32)
    )
    assert make_optimizer(
        OptimizerSpec("RMSprop", {"momentum": 0.5, "centered": True})
    ).slot_names == (
        "velocity",
        "momentum",
        "average_gradient",
    )


def test_spec_json_round_trip():
    for make_keras in CONFIGS.values():
        spec = optimizer_spec_from_keras(make_keras())
        back = OptimizerSpec.from_json_dict(json.loads(json.dumps(spec.to_json_dict())))
        assert back == spec
    with pytest.raises(ValueError):
        OptimizerSpec.from_json_dict({"name": "SGD"})


class _Lookalike:
    """A user class that shares a supported name but not Keras's math."""

    def get_config(self):
        return {"learning_rate": 0.1}


_Lookalike.__name__ = "Adam"


class _MyAdam(opts.Adam):
    pass


def _excluded_adam():
    opt = opts.Adam(weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


@pytest.mark.parametrize(
    "make_keras, needles",
    [
        (lambda: opts.Nadam(), ["keras.optimizers.Nadam", "SGD, Adam, AdamW, Adagrad, RMSprop"]),
        (lambda: opts.Ftrl(), ["Ftrl", "Return one of those"]),
        (lambda: _MyAdam(), ["_MyAdam", "SGD, Adam, AdamW, Adagrad, RMSprop"]),
        (_Lookalike, ["test_ps_optimizers.Adam", "not Keras 3's own"]),
        (lambda: opts.LossScaleOptimizer(opts.SGD()), ["LossScaleOptimizer"]),
        (
            lambda: opts.Adam(learning_rate=opts.schedules.ExponentialDecay(0.1, 10, 0.9)),
            [
                "ExponentialDecay",
                "LearningRateSchedule",
                "learning_rate_scheduler(model_version)",
            ],
        ),
        (
            lambda: opts.SGD(learning_rate=lambda: 0.1),
            ["callable", "learning_rate_scheduler(model_version)"],
        ),
        (lambda: opts.SGD(global_clipnorm=1.0), ["global_clipnorm", "clipnorm"]),
        (lambda: opts.Adam(use_ema=True), ["use_ema"]),
        (
            lambda: opts.Adam(gradient_accumulation_steps=4),
            ["gradient_accumulation_steps"],
        ),
        (lambda: opts.RMSprop(loss_scale_factor=128.0), ["loss_scale_factor"]),
        (_excluded_adam, ["exclude_from_weight_decay"]),
    ],
)
def test_unsupported_raises_with_named_cause(make_keras, needles):
    with pytest.raises(UnsupportedOptimizerError) as info:
        optimizer_spec_from_keras(make_keras())
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize(
    "spec, needle",
    [
        (OptimizerSpec("Nadam", {}), "Nadam"),
        (
            OptimizerSpec("Adam", {"learning_rate": {"class_name": "CosineDecay"}}),
            "CosineDecay",
        ),
        (OptimizerSpec("SGD", {"use_ema": True}), "use_ema"),
        (OptimizerSpec("Adam", {"beta_1": "0.9"}), "beta_1"),
    ],
)
def test_make_optimizer_rejects_bad_specs(spec, needle):
    with pytest.raises(UnsupportedOptimizerError, match=needle):
        make_optimizer(spec)


def _rows_vs_dense(spec: OptimizerSpec, steps: int = 3):
    """Update rows [2, 5] via gather/apply/scatter and via a dense, mostly-zero grad."""
    rng = np.random.default_rng(7)
    rows = np.array([2, 5])
    opt = make_optimizer(spec)
    table = rng.normal(size=(8, 3)).astype(np.float32)
    dense, dense_slots = table.copy(), opt.create_slots(table)
    sub, sub_slots = table.copy(), opt.create_slots(table)
    for step in range(1, steps + 1):
        row_grad = rng.normal(size=(len(rows), 3)).astype(np.float32)
        dense_grad = np.zeros_like(table)
        dense_grad[rows] = row_grad
        opt.apply(dense, dense_grad, dense_slots, step)

        p = sub[rows]
        s = {k: v[rows] for k, v in sub_slots.items()}
        opt.apply(p, row_grad, s, step)
        sub[rows] = p
        for k, v in s.items():
            sub_slots[k][rows] = v
    return table, dense, sub, rows


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec("SGD", {"learning_rate": 0.1}),
        OptimizerSpec("Adagrad", {"learning_rate": 0.1}),
    ],
)
def test_row_subset_apply_matches_dense(spec):
    table, dense, sub, rows = _rows_vs_dense(spec)
    np.testing.assert_allclose(sub, dense, **TOL)
    untouched = np.setdiff1d(np.arange(len(table)), rows)
    np.testing.assert_array_equal(sub[untouched], table[untouched])


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
        OptimizerSpec("Adam", {"learning_rate": 0.01, "amsgrad": True}),
        OptimizerSpec("RMSprop", {"momentum": 0.5, "centered": True}),
        OptimizerSpec("Adagrad", {"weight_decay": 0.1, "clipnorm": 0.5}),
    ],
)
def test_row_subset_apply_matches_dense_on_updated_rows(spec):
    # With momentum/Adam state, zero-gradient rows of the dense table still
    # move, so only the rows that were updated are comparable.
    _, dense, sub, rows = _rows_vs_dense(spec)
    np.testing.assert_allclose(sub[rows], dense[rows], **TOL)


def test_apply_validates_inputs():
    opt = make_optimizer(OptimizerSpec("SGD", {}))
    p = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="shape"):
        opt.apply(p, np.zeros((2, 3), np.float32), {}, 1)
    with pytest.raises(ValueError, match="step"):
        opt.apply(p, np.zeros((2, 2), np.float32), {}, 0)
    with pytest.raises(TypeError, match="float32"):
        opt.apply(p.astype(np.float64), np.zeros((2, 2)), {}, 1)
    g = np.ones((2, 2), np.float32)
    opt.apply(p, g, {}, 1)  # the caller's gradient is never modified
    np.testing.assert_array_equal(g, np.ones((2, 2), np.float32))


def test_module_does_not_import_tensorflow_or_keras():
    code = (
        "import sys, elasticdl.model.optimizers;"
        "bad = [m for m in ('tensorflow', 'keras') if m in sys.modules];"
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
