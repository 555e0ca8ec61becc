"""Keep the best (or every) model as a SavedModel."""

from __future__ import annotations

import logging
import os

import numpy as np

from elasticdl.callbacks.callback import Callback, better_direction

logger = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """At each epoch end, export the model when ``monitor`` improved (``save_best_only``)
    or always, to ``filepath`` (``{epoch}`` and ``{version}`` are filled in).

    Example::

        def callbacks():
            return [ModelCheckpoint("out/best", monitor="accuracy", save_best_only=True)]
    """

    def __init__(self, filepath: str, monitor: str = "loss", mode: str = "auto", save_best_only: bool = True):
        super().__init__()
        self.filepath = filepath
        self.monitor = monitor
        self.mode = better_direction(monitor, mode)
        self.save_best_only = save_best_only
        self.best = np.inf if self.mode == "min" else -np.inf
        self.best_version: int | None = None
        self.saved: list[str] = []

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.monitor)
        if self.save_best_only:
            if value is None:
                logger.warning("ModelCheckpoint: %r is not in the epoch logs", self.monitor)
                return
            better = value < self.best if self.mode == "min" else value > self.best
            if not better:
                return
            self.best = value
        # The version whose parameters (and metrics) the callbacks see, not the PS's newer one.
        version = self.job.params_version if self.job is not None else epoch
        path = self.filepath.format(epoch=epoch + 1, version=version)
        self.job.export(os.fspath(path))
        self.best_version = version
        self.saved.append(path)
        logger.info("ModelCheckpoint: saved version %d (%s=%s) to %s", version, self.monitor, value, path)
