"""Stop the job when an evaluation metric stops improving."""

from __future__ import annotations

import logging

import numpy as np

from elasticdl.callbacks.callback import Callback, better_direction

logger = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Ends training after ``patience`` epochs without improvement of ``monitor`` (as Keras's
    EarlyStopping: ``patience=2`` stops after the second epoch in a row that did not improve;
    0 or 1 after the first).

    The next epoch starts only once this callback saw the epoch's evaluation, so a stop drops
    every task of the epochs after it (docs/evaluation.md#callbacks says what that costs).

    ``monitor`` names a key of the epoch logs: ``loss`` or an eval metric (e.g.
    ``accuracy``). The job then stops cleanly: tasks in progress finish, the final
    evaluation runs and ``--output`` gets the *last* model; pair it with
    ``ModelCheckpoint(save_best_only=True)`` to keep the best one.

    Example::

        def callbacks():
            return [EarlyStopping(monitor="accuracy", patience=2)]
    """

    def __init__(self, monitor: str = "loss", min_delta: float = 0.0, patience: int = 0, mode: str = "auto"):
        super().__init__()
        if patience < 0:
            raise ValueError(f"`patience` must be 0 or more. Received: patience={patience}")
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = better_direction(monitor, mode)
        self.best = np.inf if self.mode == "min" else -np.inf
        self.wait = 0
        self.stopped_epoch: int | None = None

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.monitor)
        if value is None:
            logger.warning(
                "EarlyStopping: %r is not in the epoch logs (%s); is it in eval_metrics_fn()?",
                self.monitor, ", ".join(sorted(logs or {})) or "empty",
            )
            return
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= max(1, self.patience) and self.stopped_epoch is None:
            self.stopped_epoch = epoch
            reason = f"EarlyStopping: {self.monitor} has not improved for {self.wait} epoch{'s' if self.wait > 1 else ''} (best {self.best:.4f})"
            if self.job is not None:
                self.job.stop_training(reason)
            elif self.model is not None:
                self.model.stop_training = True
