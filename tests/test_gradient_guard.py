"""The gradient guard (elasticdl/ps/gradient_guard.py): one finite 1e38 gradient used to turn
the model into noise while the job reported success; now the PS refuses it, counts it, and the
master's report names the count."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.gradient_guard import FLOAT32_SQUARE_LIMIT, GradientGuard
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc.push_outcome import PushOutcome

PARAMS = {"dense/kernel": np.ones((3, 2), np.float32), "dense/bias": np.zeros((2,), np.float32)}


def grads(scale: float) -> dict[str, np.ndarray]:
    return {"dense/kernel": np.full((3, 2), scale, np.float32), "dense/bias": np.full((2,), scale, np.float32)}


def make_ps(optimizer: str = "SGD", **settings) -> ParameterServer:
    ps = ParameterServer(PSSettings(**settings), make_optimizer(OptimizerSpec(optimizer, {"learning_rate": 0.1})))
    assert ps.push_model({k: v.copy() for k, v in PARAMS.items()}) == (True, 0)
    return ps


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_a_1e38_gradient_leaves_the_model_intact_and_is_counted(optimizer):
    ps = make_ps(optimizer)
    ps.push_gradients(grads(0.5), 0, None)
    before = {k: v.copy() for k, v in ps.shard.params.items()}
    result = ps.push_gradients(grads(1e38), ps.shard.version, None)
    assert result.outcome is PushOutcome.REJECTED_INVALID
    assert "beyond what float32 arithmetic takes" in result.reason
    assert ps.shard.version == 1 and ps.guard.refused == 1
    for name, value in before.items():
        np.testing.assert_array_equal(ps.shard.params[name], value)
    # Training goes on: the next ordinary gradient is applied, and the model stays finite.
    assert ps.push_gradients(grads(0.5), 1, None).outcome is PushOutcome.APPLIED
    assert all(np.isfinite(v).all() for v in ps.shard.params.values())


def test_a_value_whose_square_overflows_float32_is_refused_even_with_the_ratio_off():
    ps = make_ps(max_gradient_norm_ratio=0)
    assert ps.push_gradients(grads(FLOAT32_SQUARE_LIMIT * 2), 0, None).outcome is PushOutcome.REJECTED_INVALID
    assert ps.push_gradients(grads(1e6), 0, None).outcome is PushOutcome.APPLIED  # large, but no check of ratio


def test_a_gradient_far_beyond_the_running_norm_is_refused_after_the_warmup():
    guard = GradientGuard(max_norm_ratio=100, warmup=3)
    for _ in range(3):
        assert guard.problem(grads(1.0)) == ""
        guard.passed()
    assert guard.problem(grads(50.0)) == ""  # 50 times: within the bound
    problem = guard.problem(grads(1000.0))
    assert "is 1e+03 times the running norm" in problem and "--max_gradient_norm_ratio 100" in problem
    assert guard.refused == 1 and guard.last_refusal == problem


def test_before_the_warmup_nothing_is_refused_for_its_ratio():
    guard = GradientGuard(max_norm_ratio=10, warmup=2)
    assert guard.problem(grads(1.0)) == ""
    guard.passed()
    assert guard.problem(grads(1e6)) == ""  # one measure is no running norm yet


def test_embedding_rows_count_and_non_trainable_changes_do_not():
    from elasticdl.model.non_trainable import NonTrainableChange

    guard = GradientGuard()
    rows = IndexedRows(np.array([1], np.int64), np.full((1, 4), 1e38, np.float32))
    assert "beyond what float32" in guard.problem({"table": rows})
    assert guard.problem({"bn/moving_mean": NonTrainableChange(np.full(2, 1e30, np.float32))}) == ""


def test_refusals_reach_the_stats_and_the_report_summary():
    from elasticdl.master.telemetry import summarize
    from elasticdl.rpc.ps_client import PSStats

    stats = [PSStats(5, 10, 0, 2, {}, 1, gradients_refused=2), PSStats(5, 10, 0, 0, {}, 1, gradients_refused=1)]
    summary = summarize(stats, 0.0)
    assert summary.to_dict()["gradients_refused"] == 3
    assert summary.noteworthy and "3 gradients refused by the gradient guard" in summary.describe()


def test_the_flag_is_validated_at_submit():
    from elasticdl.config import ConfigError, JobConfig

    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--max_gradient_norm_ratio must be 0 or more"):
            JobConfig.from_flags(model_zoo="z", model_def="a.b.c", training_data="d",
                                 max_gradient_norm_ratio=bad).validate(check_paths=False)
    config = JobConfig.from_flags(model_zoo="z", model_def="a.b.c", training_data="d", max_gradient_norm_ratio=0.0)
    config.validate(check_paths=False)
    assert config.consistency.max_gradient_norm_ratio == 0.0


def test_the_report_names_the_refusals_with_a_warning(caplog):
    from elasticdl.master.report import JobReport

    report = JobReport("j", staleness={"gradients_refused": 4})
    with caplog.at_level("WARNING"):
        report.note_refusals()
    assert report.gradients_refused == 4 and '"gradients_refused": 4' in report.to_json()
    assert "refused 4 gradients" in caplog.text and "--max_gradient_norm_ratio" in caplog.text
