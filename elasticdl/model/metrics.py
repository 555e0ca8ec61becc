"""Metrics from the model zoo's ``eval_metrics_fn()``, computed by workers, merged by the master.

A Keras metric object is merged by its *state*: every built-in Keras metric keeps sums
and counts (an AUC keeps its confusion buckets), so summing the states of the tasks and
computing the result once gives exactly the metric over all records, never an average of
per-task values. A plain function ``fn(labels, predictions) -> per-example values`` is
merged as a record-weighted mean (its state is ``[sum, count]``).

A multi-output model may nest metrics per output: ``{"ctr": {"auc": AUC()}, "cvr": {...}}``;
the metric then sees ``predictions["ctr"]`` and reports as ``ctr/auc``. Its labels are
``labels["ctr"]`` when the labels are a dict, else the labels tensor itself, as the original
ElasticDL passed it to every output's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from elasticdl.model.sample_weight import for_output, weighted_values


@dataclass(frozen=True)
class _Entry:
    output: str | None  # the output it applies to (nested metrics), or None for the whole
    metric: Any


def flatten_metrics(metrics: dict[str, Any]) -> dict[str, _Entry]:
    flat: dict[str, _Entry] = {}
    for name, value in metrics.items():
        if isinstance(value, dict):
            for inner, metric in value.items():
                flat[f"{name}/{inner}"] = _Entry(name, metric)
        else:
            flat[name] = _Entry(None, value)
    return flat


def _is_keras_metric(metric: Any) -> bool:
    return hasattr(metric, "update_state") and hasattr(metric, "variables")


def _select(values, output: str | None):
    if output is None:
        return values
    if isinstance(values, dict):
        return values[output]
    raise ValueError(f"metrics are nested under output {output!r} but the model/labels are not a dict")


class MetricsAccumulator:
    """One task's metrics: ``update`` per batch, then ``states`` for the master."""

    def __init__(self, metrics: dict[str, Any]):
        self._entries = flatten_metrics(metrics)
        for entry in self._entries.values():
            if _is_keras_metric(entry.metric):
                entry.metric.reset_state()
        self._sums = {n: np.zeros(2) for n, e in self._entries.items() if not _is_keras_metric(e.metric)}

    def update(self, labels, predictions, sample_weight=None) -> None:
        """One batch; ``sample_weight`` (dataset_fn's third element) weighs its examples as
        Keras's compiled metrics do (a dict of them: per output)."""
        for name, entry in self._entries.items():
            y = labels if not isinstance(labels, dict) else _select(labels, entry.output)
            p = _select(predictions, entry.output)
            w = for_output(sample_weight, entry.output)
            if _is_keras_metric(entry.metric):
                if w is None:
                    entry.metric.update_state(y, p)
                else:
                    entry.metric.update_state(y, p, sample_weight=w)
            else:
                self._sums[name] += weighted_values(entry.metric(y, p), w)

    def states(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, entry in self._entries.items():
            if _is_keras_metric(entry.metric):
                for i, var in enumerate(entry.metric.variables):
                    out[f"{name}/{i}"] = np.asarray(var.numpy())
            else:
                out[f"{name}/0"] = self._sums[name].copy()
        return out

    def result(self) -> dict[str, float]:
        return merge_states(lambda: {}, [self.states()], self._entries)


class MetricsMerger:
    """The master's side: sums task states, computes the metrics once at the end."""

    def __init__(self, metrics_fn: Callable[[], dict[str, Any]]):
        self._metrics_fn = metrics_fn
        self._sums: dict[str, np.ndarray] = {}
        self._expected: dict[str, tuple[int, ...] | None] | None = None  # see expected_states
        self.tasks = 0

    def expected_states(self) -> dict[str, tuple[int, ...] | None]:
        """The state names a task must report, each with its shape (None: a Keras metric that
        makes its variables on first use, so the first state accepted fixes the shape)."""
        if self._expected is None:
            expected: dict[str, tuple[int, ...] | None] = {}
            for name, entry in flatten_metrics(self._metrics_fn()).items():
                if not _is_keras_metric(entry.metric):
                    expected[f"{name}/0"] = (2,)
                    continue
                for i, var in enumerate(entry.metric.variables):
                    expected[f"{name}/{i}"] = tuple(int(d) for d in var.shape)
                if not entry.metric.variables:
                    expected[f"{name}/*"] = None
            self._expected = expected
        return self._expected

    def problem(self, states: dict[str, np.ndarray]) -> str:
        """Why ``states`` are not one task's states of these metrics ('' when they are):
        the names and shapes of the metrics' variables, numbers, finite."""
        expected = self.expected_states()
        lazy = {name[:-2] for name, shape in expected.items() if shape is None}
        names = set(states)
        fixed = {name for name in expected if expected[name] is not None}
        unknown = sorted(n for n in names - fixed if n.rsplit("/", 1)[0] not in lazy)
        if unknown:
            return f"unknown metric states {unknown[:3]} (the metrics have {sorted(fixed)[:6]})"
        missing = sorted(fixed - names)
        if missing:
            return f"metric states {missing[:3]} are missing"
        for name, value in states.items():
            value = np.asarray(value)
            if value.dtype.kind not in "biuf":
                return f"metric state {name!r} has dtype {value.dtype}, expected numbers"
            shape = expected.get(name)
            if shape is None and name in self._sums:  # a lazily built metric: its first state's shape
                shape = self._sums[name].shape
            if shape is not None and value.shape != tuple(shape):
                return f"metric state {name!r} has shape {value.shape}, the metric's variable has {tuple(shape)}"
            if not np.isfinite(value.astype(np.float64)).all():
                return f"metric state {name!r} contains NaN or Inf"
        return ""

    def add(self, states: dict[str, np.ndarray]) -> None:
        """Sum one task's states; ValueError (nothing summed) if ``problem`` finds one."""
        problem = self.problem(states)
        if problem:
            raise ValueError(problem)
        for name, value in states.items():
            value = np.asarray(value, dtype=np.float64)
            if name in self._sums:
                self._sums[name] += value
            else:
                self._sums[name] = value.copy()
        self.tasks += 1

    def result(self) -> dict[str, float]:
        return merge_states(self._metrics_fn, [self._sums])


def merge_states(
    metrics_fn: Callable[[], dict[str, Any]],
    states: list[dict[str, np.ndarray]],
    entries: dict[str, _Entry] | None = None,
) -> dict[str, float]:
    """Metric values from summed states, computed on fresh metric objects."""
    entries = entries if entries is not None else flatten_metrics(metrics_fn())
    summed: dict[str, np.ndarray] = {}
    for state in states:
        for name, value in state.items():
            summed[name] = summed.get(name, 0) + np.asarray(value, dtype=np.float64)
    results: dict[str, float] = {}
    for name, entry in entries.items():
        if _is_keras_metric(entry.metric):
            if f"{name}/0" not in summed:
                continue
            for i, var in enumerate(entry.metric.variables):
                var.assign(np.asarray(summed[f"{name}/{i}"], dtype=getattr(var.dtype, "as_numpy_dtype", var.dtype)))  # Keras 2: a tf.DType
            results[name] = float(np.asarray(entry.metric.result()))
        else:
            total, count = summed.get(f"{name}/0", np.zeros(2))
            results[name] = float(total / count) if count else float("nan")
    return results
