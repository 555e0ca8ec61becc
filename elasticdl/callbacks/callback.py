"""The base class of ElasticDL's callbacks and the job handle they act through."""

from __future__ import annotations

from typing import Protocol

import keras

# Metrics that are better higher; any other (loss, mse, error, ...) is better lower.
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1", "iou")


def better_direction(monitor: str, mode: str) -> str:
    """``mode`` ("min", "max", or "auto": by the metric's name) as "min" or "max"."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"`mode` must be 'auto', 'min' or 'max'. Received: mode={mode!r}")
    if mode != "auto":
        return mode
    name = monitor.lower()
    return "max" if any(word in name for word in _HIGHER_IS_BETTER) and "loss" not in name else "min"


class JobControl(Protocol):
    """What a callback may do to the running job (the master implements it)."""

    @property
    def model_version(self) -> int:
        """The newest model version the master has seen."""

    @property
    def params_version(self) -> int:
        """The version of the parameters in the callbacks' model: at an epoch end, the
        snapshot that epoch's evaluation round evaluated (so the metrics are this version's)."""

    def stop_training(self, reason: str) -> None:
        """Finish cleanly: no new training tasks; the final evaluation and export still run."""

    def set_learning_rate(self, learning_rate: float | None) -> None:
        """The learning rate the PS applies from now on (0: no update; None: the optimizer's own)."""

    def export(self, path: str) -> str:
        """Export the master's model as a SavedModel: the parameters the callback sees now."""


class Callback(keras.callbacks.Callback):
    """A Keras callback that also gets the job handle and every new model version."""

    def __init__(self):
        super().__init__()
        self.job: JobControl | None = None

    def set_job(self, job: JobControl) -> None:
        self.job = job

    def on_model_version(self, version: int) -> None:
        """Called by the master when the model version moved (at most every poll)."""
