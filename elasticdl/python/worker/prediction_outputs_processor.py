"""``BasePredictionOutputsProcessor`` (the original's path): a model zoo's
``PredictionOutputsProcessor`` subclasses it and implements ``process``."""

import abc


class BasePredictionOutputsProcessor(abc.ABC):
    """``process(predictions, worker_id)`` is called with each batch's model outputs (tensors,
    or a dict or list of them, as the model returns them) in every prediction task."""

    @abc.abstractmethod
    def process(self, predictions, worker_id):
        """Handle one batch of predictions, e.g. write them to a table."""


__all__ = ["BasePredictionOutputsProcessor"]
