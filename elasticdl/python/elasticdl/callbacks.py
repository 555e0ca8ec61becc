"""``from elasticdl.python.elasticdl.callbacks import LearningRateScheduler`` (the original's path).

``LearningRateScheduler(schedule)`` calls ``schedule(model_version)`` as the original did.
"""

from elasticdl.callbacks import (
    EarlyStopping,
    LearningRateScheduler,
    ModelCheckpoint,
    SavedModelExporter,
)

__all__ = ["EarlyStopping", "LearningRateScheduler", "ModelCheckpoint", "SavedModelExporter"]
