"""``from elasticdl.python.elasticdl.callbacks import LearningRateScheduler`` (the original's path).

``LearningRateScheduler(schedule)`` calls ``schedule(model_version)`` as the original did;
``MaxStepsStopping(max_steps)`` ends training once the model version reaches ``max_steps``.
"""

from __future__ import annotations

from elasticdl.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateScheduler,
    ModelCheckpoint,
    SavedModelExporter,
)


class MaxStepsStopping(Callback):
    """Stops training (cleanly: the final evaluation and export still run) once the model version,
    one per applied update as the original counted steps, reaches ``max_steps``.

    Example::

        def callbacks():
            return [MaxStepsStopping(max_steps=1000)]
    """

    def __init__(self, max_steps: int):
        super().__init__()
        if max_steps <= 0:
            raise ValueError(f"`max_steps` must be a positive integer. Received: max_steps={max_steps}")
        self.max_steps = int(max_steps)
        self.stopped_at: int | None = None

    def on_model_version(self, version: int) -> None:
        if self.stopped_at is not None or version < self.max_steps or self.job is None:
            return
        self.stopped_at = version
        self.job.stop_training(f"MaxStepsStopping: model version {version} reached max_steps={self.max_steps}")


__all__ = [
    "EarlyStopping", "LearningRateScheduler", "MaxStepsStopping", "ModelCheckpoint", "SavedModelExporter",
]
