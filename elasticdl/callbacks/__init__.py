"""Keras-style callbacks for ElasticDL jobs, returned by the model zoo's ``callbacks()``.

The master calls ``on_train_begin``, ``on_epoch_begin``, ``on_epoch_end`` (with the
epoch's logs: ``loss`` and the evaluation metrics) and ``on_train_end``. Any
``keras.callbacks.Callback`` subclass works; ``self.model`` is the master's copy of the
model, holding the PS parameters at each epoch end, and setting
``self.model.stop_training = True`` (as Keras's own EarlyStopping does) ends the job.
ElasticDL's callbacks also get ``self.job`` (see ``JobControl``) to act on the job.
"""

from elasticdl.callbacks.callback import Callback, JobControl
from elasticdl.callbacks.callback_list import CallbackList
from elasticdl.callbacks.early_stopping import EarlyStopping
from elasticdl.callbacks.learning_rate_scheduler import LearningRateScheduler
from elasticdl.callbacks.model_checkpoint import ModelCheckpoint
from elasticdl.callbacks.saved_model_exporter import SavedModelExporter

__all__ = [
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "JobControl",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "SavedModelExporter",
]
