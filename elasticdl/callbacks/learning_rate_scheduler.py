"""Set the PS learning rate by model version or by epoch."""

from __future__ import annotations

from collections.abc import Callable

from elasticdl.callbacks.callback import Callback
from elasticdl.model.optimizers import learning_rate_problem
from elasticdl.model.spec import ModelSpecError


class LearningRateScheduler(Callback):
    """``schedule(version_or_epoch) -> learning rate``, applied on every PS.

    ``by="version"`` calls it whenever the model version moves, ``by="epoch"`` at each
    epoch's start. A rate the worker sends (the model zoo's ``learning_rate_scheduler``)
    takes precedence over this one. 0 is a rate: the updates change nothing (a pause in
    training); ``None`` goes back to the optimizer's own rate.

    Example::

        def callbacks():
            return [LearningRateScheduler(lambda epoch: 0.1 * 0.5 ** epoch, by="epoch")]
    """

    def __init__(self, schedule: Callable[[int], float | None], by: str = "version"):
        super().__init__()
        if by not in ("version", "epoch"):
            raise ValueError(f"`by` must be 'version' or 'epoch'. Received: by={by!r}")
        self.schedule = schedule
        self.by = by
        self.current: float | None = None  # the rate last set; None: the optimizer's own

    def _apply(self, step: int) -> None:
        rate = self.schedule(step)
        learning_rate = None if rate is None else float(rate)
        problem = learning_rate_problem(learning_rate) if learning_rate is not None else ""
        if problem:  # the PS would refuse it: say so here, naming the schedule, before any call
            raise ModelSpecError(f"LearningRateScheduler: schedule({step}) by {self.by}: {problem}")
        if learning_rate != self.current and self.job is not None:
            self.job.set_learning_rate(learning_rate)
            self.current = learning_rate

    def on_train_begin(self, logs=None):
        self._apply(0)

    def on_epoch_begin(self, epoch, logs=None):
        if self.by == "epoch":
            self._apply(epoch)

    def on_model_version(self, version):
        if self.by == "version":
            self._apply(version)
