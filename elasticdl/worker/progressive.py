"""Progressive validation on the worker: each training batch scored before it is trained on.

The standard online-learning metric: every record is predicted by a model that has not seen
it yet, so the scores measure generalization without a held-out split. The worker scores a
batch with the model zoo's ``eval_metrics_fn`` on the parameters its gradients are computed
on, just before it computes them (so before they are pushed), in inference mode. The metric
*states* of a task's batches travel with its report; the master merges them per window of
records (elasticdl/master/progressive.py), as evaluation merges tasks: sums of states, never
averages of per-task values.

A batch computed again (a sync PS refused its gradients as stale) is scored once: the
batch's position names it (``score``'s ``key``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticdl.model.metrics import MetricsAccumulator


class ProgressiveScore:
    """One task's progressive scores: ``start`` a task, ``score`` each batch, ``take`` the states."""

    def __init__(self, metrics_fn: Callable[[], dict[str, Any]]):
        self._metrics = MetricsAccumulator(metrics_fn())
        self._metrics_fn = metrics_fn
        self._last_key: object = None
        self.batches = 0

    def start(self) -> None:
        """A training task begins: no score of an earlier task is carried into it."""
        self._metrics = MetricsAccumulator(self._metrics_fn())
        self._last_key = None
        self.batches = 0

    def score(self, key: object, trainer, features, labels) -> bool:
        """Score one batch on ``trainer``'s model as it is now (before its gradients exist); False
        when the batch named ``key`` was scored already (None: always scored). A row lookup that
        failed (a PS away) raises its own error, as ``compute_gradients`` does: the batch loop
        retries it, and the batch is scored then."""
        if key is not None and key == self._last_key:
            return False
        self._metrics.update(labels, predict(trainer, features))
        self._last_key = key
        self.batches += 1
        return True

    def take(self) -> dict | None:
        """The task's metric states (None: no batch was scored), and a fresh start."""
        states = self._metrics.states() if self.batches else None
        self.start()
        return states


def predict(trainer, features):
    """The model's predictions in inference mode (its embedding rows read, never created: an id
    not trained yet is unknown to the model; after the batch's pull, as they are on the PS now).
    The error of a failed row lookup is raised as it is, not as the TensorFlow error wrapping it."""
    tables = trainer.embeddings
    tables.error = None
    try:
        return trainer.model(features, training=False)
    except Exception as err:
        if tables.error is not None:
            raise tables.error from err
        raise
