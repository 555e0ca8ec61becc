"""Metrics over a data set, from the model zoo's ``eval_metrics_fn()``.

Keras metric objects accumulate their state; plain functions give per-example values
that are averaged weighted by record count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elasticdl.data.sources import read_records, record_format
from elasticdl.mode import Mode
from elasticdl.model_spec import DatasetMetadata, ModelSpec


class MetricsAccumulator:
    def __init__(self, metrics: dict[str, Any]):
        self._metrics = metrics
        self._sums = {name: 0.0 for name, m in metrics.items() if not hasattr(m, "update_state")}
        self._counts = dict.fromkeys(self._sums, 0)

    def update(self, labels, predictions) -> None:
        for name, metric in self._metrics.items():
            if hasattr(metric, "update_state"):
                metric.update_state(labels, predictions)
            else:
                values = np.asarray(metric(labels, predictions), dtype=np.float64).reshape(-1)
                self._sums[name] += float(values.sum())
                self._counts[name] += values.size

    def result(self) -> dict[str, float]:
        out = {}
        for name, metric in self._metrics.items():
            if hasattr(metric, "update_state"):
                out[name] = float(np.asarray(metric.result()))
            else:
                out[name] = self._sums[name] / max(1, self._counts[name])
        return out


def evaluate(
    spec: ModelSpec,
    model,
    metrics: dict[str, Any],
    files: list[tuple[str, int]],
    batch_size: int,
    has_header: bool = False,
) -> dict[str, float]:
    """Run ``model`` over every record of ``files`` and return the metrics."""
    from elasticdl.worker.trainer import make_dataset

    accumulator = MetricsAccumulator(metrics)
    for path, count in files:
        records = list(read_records(path, 0, count, has_header))
        metadata = DatasetMetadata(record_format(path))
        for features, labels in make_dataset(spec, records, Mode.EVALUATION, metadata, batch_size):
            accumulator.update(labels, model(features, training=False))
    return accumulator.result()
