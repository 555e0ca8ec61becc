"""A list of callbacks that is itself a callback."""

from __future__ import annotations

from typing import Any


class CallbackList:
    def __init__(self, callbacks: list[Any] | None = None, model=None, job=None):
        self.callbacks = list(callbacks or [])
        for callback in self.callbacks:
            if model is not None and hasattr(callback, "set_model"):
                callback.set_model(model)
            if job is not None and hasattr(callback, "set_job"):
                callback.set_job(job)

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._call("on_train_begin", logs or {})

    def on_train_end(self, logs: dict | None = None) -> None:
        self._call("on_train_end", logs or {})

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._call("on_epoch_begin", epoch, logs or {})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._call("on_epoch_end", epoch, logs or {})

    def on_model_version(self, version: int) -> None:
        self._call("on_model_version", version)
