"""Load a model-zoo module and check it against the contract, with messages that name the fix.

The contract (compatible with the original ElasticDL's model zoo)::

    custom_model(**model_params) -> keras.Model      # the name given in --model_def
    loss(labels, predictions) -> scalar tensor
    optimizer(lr=...) -> keras optimizer
    dataset_fn(dataset, mode, metadata) -> tf.data.Dataset   # older name: feed
    eval_metrics_fn() -> {name: keras.metrics.Metric | fn(labels, predictions)}   # optional
    callbacks(), learning_rate_scheduler(model_version), PredictionOutputsProcessor  # optional
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from elasticdl.errors import UserError


class ModelSpecError(UserError, ValueError):
    """The model-zoo module does not meet the contract."""


# name -> (expected signature, how many positional parameters it must accept)
_REQUIRED = {
    "loss": ("loss(labels, predictions) -> scalar tensor", 2),
    "optimizer": ("optimizer(lr=0.1) -> a keras.optimizers.Optimizer", 0),
    "dataset_fn": (
        "dataset_fn(dataset, mode, metadata) -> tf.data.Dataset of (features, labels)",
        3,
    ),
}
_OPTIONAL = {
    "eval_metrics_fn": ("eval_metrics_fn() -> {name: keras.metrics.Metric or fn(labels, predictions)}", 0),
    "callbacks": ("callbacks() -> [keras.callbacks.Callback, ...]", 0),
    "learning_rate_scheduler": ("learning_rate_scheduler(model_version) -> float", 1),
}


@dataclass(frozen=True)
class DatasetMetadata:
    """The third argument of ``dataset_fn``: what the raw records are."""

    record_format: str  # "tfrecord" or "parquet" (serialized tf.train.Example), or "csv" (text lines)
    column_names: tuple[str, ...] = ()


@dataclass
class ModelSpec:
    """The callables of one model-zoo module."""

    module_path: str
    model_name: str
    model_fn: Callable[..., Any]
    loss: Callable[[Any, Any], Any]
    optimizer: Callable[..., Any]
    dataset_fn: Callable[[Any, Any, DatasetMetadata], Any]
    eval_metrics_fn: Callable[[], dict] | None = None
    callbacks: Callable[[], list] | None = None
    learning_rate_scheduler: Callable[[int], float] | None = None
    prediction_outputs_processor: type | None = None

    def build_model(self, model_params: dict[str, Any]):
        """A fresh model with deterministic variable names.

        Keras names layers from process-wide counters; clearing the session first gives
        every process (workers, the exporting master) the same variable paths.
        """
        import keras

        keras.backend.clear_session()
        try:
            model = self.model_fn(**model_params)
        except ModelSpecError:
            raise
        except TypeError as err:
            raise ModelSpecError(
                f"{self.module_path}: {self.model_name}(**model_params) failed: {err}. "
                "Check --model_params against the function's parameters."
            ) from err
        except Exception as err:  # the user's code raised: name it, without a traceback of ours
            params = ", ".join(f"{k}={v!r}" for k, v in model_params.items())
            raise ModelSpecError(
                f"{self.module_path}: {self.model_name}({params}) raised {type(err).__name__}: {err}. "
                f"Fix {self.model_name} (call it in Python with the same --model_params to see where)."
            ) from err
        if not isinstance(model, keras.Model):
            raise ModelSpecError(
                f"{self.module_path}: {self.model_name}() must return a keras.Model "
                f"(functional, Sequential or subclassed). Received: {type(model).__name__}"
            )
        return model


def model_def_path(model_zoo: str, model_def: str) -> tuple[str, str, str]:
    """(module name, model name, module file) of ``--model_def pkg.module.name``; the file must
    exist. Imports nothing: a typo fails before TensorFlow is loaded."""
    module_name, _, model_name = model_def.rpartition(".")
    if not module_name or not model_name:
        raise ModelSpecError(
            f"--model_def must be pkg.module.name (e.g. digits.digits_functional.custom_model). "
            f"Received: {model_def!r}"
        )
    module_path = os.path.join(model_zoo, *module_name.split(".")) + ".py"
    if not os.path.isfile(module_path):
        raise ModelSpecError(
            f"--model_def {model_def!r} points to {module_path}, which does not exist. "
            f"Check --model_zoo ({model_zoo!r}) and the module path."
        )
    return module_name, model_name, module_path


def load_model_spec(model_zoo: str, model_def: str) -> ModelSpec:
    """Import ``model_zoo/pkg/module.py`` for ``--model_def pkg.module.name`` and check it."""
    module_name, model_name, module_path = model_def_path(model_zoo, model_def)
    module = _import(model_zoo, module_name, module_path)

    model_fn = getattr(module, model_name, None)
    if model_fn is None or not callable(model_fn):
        raise ModelSpecError(
            f"{module_path}: missing `{model_name}` (from --model_def). Expected "
            f"{model_name}(**model_params) -> keras.Model, a function or a keras.Model subclass."
        )
    found: dict[str, Callable] = {}
    for name, (signature, n_args) in _REQUIRED.items():
        fn = getattr(module, name, None)
        if fn is None and name == "dataset_fn":
            fn = getattr(module, "feed", None)  # the original ElasticDL's older name
        if fn is None:
            raise ModelSpecError(f"{module_path}: missing `{name}`. Expected {signature}.")
        _check_callable(module_path, name, fn, signature, n_args)
        found[name] = fn
    optional: dict[str, Callable | None] = {}
    for name, (signature, n_args) in _OPTIONAL.items():
        fn = getattr(module, name, None)
        if fn is not None:
            _check_callable(module_path, name, fn, signature, n_args)
        optional[name] = fn
    processor = getattr(module, "PredictionOutputsProcessor", None)
    if processor is not None and not callable(getattr(processor, "process", None)):
        raise ModelSpecError(
            f"{module_path}: PredictionOutputsProcessor must define "
            "process(self, predictions, worker_id)."
        )
    return ModelSpec(
        module_path=module_path,
        model_name=model_name,
        model_fn=model_fn,
        loss=found["loss"],
        optimizer=found["optimizer"],
        dataset_fn=found["dataset_fn"],
        eval_metrics_fn=optional["eval_metrics_fn"],
        callbacks=optional["callbacks"],
        learning_rate_scheduler=optional["learning_rate_scheduler"],
        prediction_outputs_processor=processor,
    )


def _import(model_zoo: str, module_name: str, module_path: str) -> ModuleType:
    zoo = os.path.abspath(model_zoo)
    if zoo not in sys.path:
        sys.path.insert(0, zoo)
    try:
        return importlib.import_module(module_name)
    except Exception as err:  # the user's module failed to import: show why
        raise ModelSpecError(
            f"{module_path}: importing the module failed: {type(err).__name__}: {err}"
        ) from err


def _check_callable(module_path: str, name: str, fn: Any, signature: str, n_args: int) -> None:
    if not callable(fn):
        raise ModelSpecError(f"{module_path}: `{name}` must be callable. Expected {signature}.")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins and C callables: cannot inspect, trust them
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) > n_args or (len(positional) < n_args and not varargs):
        got = f"{name}{inspect.signature(fn)}"
        raise ModelSpecError(
            f"{module_path}: `{got}` has the wrong parameters. Expected {signature}."
        )
