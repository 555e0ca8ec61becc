"""Load a model-zoo module and check it against the contract, with messages that name the fix.

The contract (compatible with the original ElasticDL's model zoo)::

    custom_model(**model_params) -> keras.Model      # the name given in --model_def
    loss(labels, predictions) -> scalar tensor
    optimizer(lr=...) -> keras optimizer
    dataset_fn(dataset, mode, metadata) -> tf.data.Dataset   # older name: feed
    eval_metrics_fn() -> {name: keras.metrics.Metric | fn(labels, predictions)}   # optional
    callbacks(), learning_rate_scheduler(model_version), PredictionOutputsProcessor  # optional
    class_weight() -> {class id: weight}   # optional: fit(class_weight=...)
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from elasticdl.config.suggest import attribute_hint
from elasticdl.errors import UserError

logger = logging.getLogger(__name__)


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

    record_format: str  # "tfrecord", "recordio" or "parquet" (serialized tf.train.Example, or columns), or "csv" (text lines)
    column_names: tuple[str, ...] = ()  # records=columns: the dict keys of each row


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
    # fit(class_weight=...): {class id: weight} from --class_weight or the module's class_weight()
    class_weight: dict[int, float] = field(default_factory=dict)

    def build_model(self, model_params: dict[str, Any]):
        """A fresh model with deterministic variable names.

        Keras names layers from process-wide counters; clearing the session first gives
        every process (workers, the exporting master) the same variable paths.
        """
        from elasticdl.model.keras_generation import keras_module

        keras = keras_module()  # tf_keras for a Keras 2 module (TF_USE_LEGACY_KERAS=1)
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
            from elasticdl.model.keras_generation import legacy_active

            other = "3 (keras.Model)" if legacy_active() else "2 (tf_keras / tf.keras under TF_USE_LEGACY_KERAS=1)"
            hint = (f" It looks like a Keras {other} model: pass --keras_version {other[0]}."
                    if _is_keras_model(model) else "")
            raise ModelSpecError(
                f"{self.module_path}: {self.model_name}() must return a {keras.__name__}.Model "
                f"(functional, Sequential or subclassed). Received: {type(model).__name__}.{hint}"
            )
        from elasticdl.model.keras_generation import feed_dicts_as_keras2_did

        feed_dicts_as_keras2_did(model)  # an unnamed Input fed a dict, as the original zoo does
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


def _is_keras_model(value) -> bool:
    return any(c.__name__ == "Model" and c.__module__.split(".")[0] in ("keras", "tf_keras")
               for c in type(value).__mro__)


def load_model_spec(model_zoo: str, model_def: str, names: dict[str, str] | None = None,
                    class_weight: dict[int, float] | None = None) -> ModelSpec:
    """Import ``model_zoo/pkg/module.py`` for ``--model_def pkg.module.name`` and check it.

    ``names`` maps a contract name (``dataset_fn``, ``loss``, ``optimizer``, ``eval_metrics_fn``,
    ``callbacks``, ``custom_data_reader``, ``PredictionOutputsProcessor``) to the name to look up
    in the module: the original ElasticDL's ``--feed``, ``--loss`` ... flags. ``class_weight``
    (``--class_weight``), when not empty, replaces the module's ``class_weight()``.
    """
    names = {k: v for k, v in (names or {}).items() if v}
    module_name, model_name, module_path = model_def_path(model_zoo, model_def)
    module = _import(model_zoo, module_name, module_path)

    model_fn = getattr(module, model_name, None)
    if model_fn is None or not callable(model_fn):
        raise ModelSpecError(
            f"{module_path}: missing `{model_name}` (from --model_def). Expected "
            f"{model_name}(**model_params) -> keras.Model, a function or a keras.Model subclass."
            + attribute_hint(model_name, module)
        )
    reader_name = names.get("custom_data_reader", "custom_data_reader")
    if getattr(module, reader_name, None) is not None:
        raise ModelSpecError(
            f"{module_path}: defines `{reader_name}`, the original ElasticDL's custom data reader, which "
            "is not supported: the master cuts tasks from the files themselves (TFRecord, CSV, RecordIO). "
            "Write the data in one of those formats and parse it in dataset_fn, then remove it "
            "(or pass --custom_data_reader to another name)."
        )
    found: dict[str, Callable] = {}
    for name, (signature, n_args) in _REQUIRED.items():
        flag_name = FLAG_OF[name]
        attr = names.get(name, name)
        fn = getattr(module, attr, None)
        if fn is None and name == "dataset_fn" and name not in names:
            fn = getattr(module, "feed", None)  # the original ElasticDL's name
            attr = "feed" if fn is not None else attr
        if fn is None:
            renamed = f" (named by {flag_name})" if name in names else ""
            raise ModelSpecError(f"{module_path}: missing `{attr}`{renamed}. Expected {signature}."
                                 + attribute_hint(attr, module))
        if name == "dataset_fn":
            fn = _accept_metadata(fn)
        _check_callable(module_path, attr, fn, signature, n_args)
        found[name] = _mean_of_per_example(module_path, attr, fn) if name == "loss" else fn
    optional: dict[str, Callable | None] = {}
    for name, (signature, n_args) in _OPTIONAL.items():
        attr = names.get(name, name)
        fn = getattr(module, attr, None)
        if fn is not None:
            _check_callable(module_path, attr, fn, signature, n_args)
        optional[name] = fn
    processor_name = names.get("PredictionOutputsProcessor", "PredictionOutputsProcessor")
    processor = getattr(module, processor_name, None)
    if processor is not None and not callable(getattr(processor, "process", None)):
        raise ModelSpecError(
            f"{module_path}: {processor_name} must define "
            "process(self, predictions, worker_id)."
        )
    weights = dict(class_weight) if class_weight else _module_class_weight(module, module_path)
    return ModelSpec(
        class_weight=weights,
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


# The module's optional class_weight() -> {class id: weight} (fit's class_weight; --class_weight wins).
CLASS_WEIGHT_FUNCTION = "class_weight"


def _module_class_weight(module: ModuleType, module_path: str) -> dict[int, float]:
    """The weights of the module's ``class_weight()`` (a dict is taken as it is); {} without one."""
    from elasticdl.config.class_weight import check_class_weight
    from elasticdl.config.errors import ConfigError

    fn = getattr(module, CLASS_WEIGHT_FUNCTION, None)
    if fn is None:
        return {}
    try:
        value = fn() if callable(fn) else fn
    except Exception as err:
        raise ModelSpecError(f"{module_path}: {CLASS_WEIGHT_FUNCTION}() failed: {type(err).__name__}: {err}") from err
    try:
        return check_class_weight(value, f"{module_path}: {CLASS_WEIGHT_FUNCTION}()")
    except ConfigError as err:
        raise ModelSpecError(str(err)) from None


# The original ElasticDL's flag naming each function.
FLAG_OF = {"dataset_fn": "--feed", "loss": "--loss", "optimizer": "--optimizer",
           "eval_metrics_fn": "--eval_metrics_fn", "callbacks": "--callbacks",
           "learning_rate_scheduler": "(no flag)"}


def _mean_of_per_example(module_path: str, name: str, fn: Callable) -> Callable:
    """A loss that returns one value per example is reduced by its mean, as Keras reduces
    per-example losses (``sum_over_batch_size``) and as the original ElasticDL did; said once."""
    warned = []

    def loss(labels, predictions):
        import tensorflow as tf

        value = fn(labels, predictions)
        rank = getattr(getattr(value, "shape", None), "rank", None)
        if rank == 0:
            return value
        if not warned:
            warned.append(True)
            logger.warning(
                "%s: %s(labels, predictions) returns shape %s, not a scalar: training on its mean over "
                "the batch, as Keras does. Return tf.reduce_mean(...) to say so and silence this.",
                module_path, name, tuple(value.shape) if rank is not None else "(unknown)",
            )
        return tf.reduce_mean(value)

    loss.__name__ = getattr(fn, "__name__", name)
    loss.__wrapped__ = fn
    return loss


def _accept_metadata(fn: Callable) -> Callable:
    """The original's older ``dataset_fn(dataset, mode)``: called without the metadata."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) == 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        def dataset_fn(dataset, mode, metadata):
            return fn(dataset, mode)

        dataset_fn.__name__ = getattr(fn, "__name__", "dataset_fn")
        return dataset_fn
    return fn


def _import(model_zoo: str, module_name: str, module_path: str) -> ModuleType:
    """Import the module from the zoo without hiding installed packages.

    The zoo goes at the *end* of ``sys.path``; the model's own top-level package is bound to
    the zoo's copy explicitly, and ``model_zoo`` (the original ElasticDL's ``from
    model_zoo.x import y``) names the zoo directory unless an installed package has that name.
    """
    zoo = os.path.abspath(model_zoo)
    if zoo not in sys.path:
        sys.path.append(zoo)
    try:
        _bind_top_package(zoo, module_name.split(".")[0])
        _bind_model_zoo_alias(zoo)
        return importlib.import_module(module_name)
    except Exception as err:  # the user's module failed to import: show why
        raise ModelSpecError(
            f"{module_path}: importing the module failed: {type(err).__name__}: {err}"
        ) from err


def _bind_top_package(zoo: str, top: str) -> None:
    existing = sys.modules.get(top)
    origin = getattr(existing, "__file__", None) or ""
    paths = list(getattr(existing, "__path__", []) or [])
    if existing is not None and (origin.startswith(zoo + os.sep) or any(p.startswith(zoo + os.sep) for p in paths)):
        return
    spec = importlib.machinery.PathFinder.find_spec(top, [zoo])
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(top, None)
        raise


def _bind_model_zoo_alias(zoo: str) -> None:
    name = "model_zoo"
    existing = sys.modules.get(name)
    if existing is not None:
        if getattr(existing, "__elasticdl_zoo__", False):
            existing.__path__ = [zoo]  # another zoo in the same process (tests)
            return
        if _regular_package(getattr(existing, "__spec__", None)):
            return  # an installed package called model_zoo: leave it alone
    elif _regular_package(importlib.util.find_spec(name)):
        return
    module = ModuleType(name)
    module.__path__ = [zoo]
    module.__elasticdl_zoo__ = True
    sys.modules[name] = module


def _regular_package(spec) -> bool:
    """A module or package with files of its own, not a namespace package of directories."""
    return spec is not None and spec.origin not in (None, "namespace")


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
