"""What a parameter server's optimizer is: its name and Keras config (``OptimizerSpec``), taken
from the user's Keras optimizer and checked (elasticdl/model/optimizers.py applies it in numpy).

Only the Keras optimizers the PS re-implements are accepted, with every option it follows;
anything else (a schedule, a legacy decay, an unknown option) is refused at submit with the way
to get the same training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from elasticdl.errors import UserError

SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("SGD", "Adam", "Adagrad", "RMSprop")

# The largest learning rate a PS takes from a push or from the master. No optimizer we know of
# trains with a rate near it (SGD with linear scaling, LARS: tens at most); above it the rate
# is a bug, e.g. a schedule that returns the step instead of a rate, and one update would
# destroy the model. Zero on the wire means "the optimizer's own rate".
MAX_LEARNING_RATE = 100.0


def learning_rate_problem(value: float) -> str:
    """Why ``value`` is no learning rate a PS takes; '' when it is one. 0 is one: no update
    (the optimizer's own rate is asked for with no rate at all, None)."""
    if not math.isfinite(value):
        return f"learning rate {value} is not a finite number"
    if value < 0:
        return f"learning rate {value} is negative (0 applies no update; send none for the optimizer's own rate)"
    if value > MAX_LEARNING_RATE:
        return (
            f"learning rate {value:g} is above {MAX_LEARNING_RATE:g}, the largest a parameter server "
            "takes: does the schedule return a step count instead of a rate?"
        )
    return ""


# Keras classes accepted under another spec name. AdamW subclasses Adam and
# only changes the default of `weight_decay`, which the config carries.
_ALIASES = {"AdamW": "Adam"}

# Keras 3 defaults, used when a spec (e.g. hand-written JSON) omits a key.
DEFAULTS: dict[str, dict[str, Any]] = {
    "SGD": {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
    "Adam": {
        "learning_rate": 0.001,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "amsgrad": False,
    },
    "Adagrad": {
        "learning_rate": 0.001,
        "initial_accumulator_value": 0.1,
        "epsilon": 1e-7,
    },
    "RMSprop": {
        "learning_rate": 0.001,
        "rho": 0.9,
        "momentum": 0.0,
        "epsilon": 1e-7,
        "centered": False,
    },
}

_BOOL_OPTIONS = frozenset({"nesterov", "amsgrad", "centered"})

# Base-optimizer options that need state or a view across all variables
# (or across steps), which a PS holding a shard of the variables cannot
# reproduce. Value: why / what to do instead.
_UNSUPPORTED_OPTIONS: dict[str, str] = {
    "global_clipnorm": (
        "it clips by the norm of all gradients together, which no single "
        "parameter-server shard sees; use `clipnorm` (per variable) or "
        "`clipvalue` instead"
    ),
    "use_ema": (
        "the exponential moving average of the weights is not kept on the "
        "parameter server; remove `use_ema`"
    ),
    "gradient_accumulation_steps": (
        "accumulate gradients by using a larger minibatch instead; remove "
        "`gradient_accumulation_steps`"
    ),
    "loss_scale_factor": (
        "the parameter server applies unscaled gradients; remove "
        "`loss_scale_factor` (and any LossScaleOptimizer)"
    ),
}

_LR_SCHEDULER_HINT = (
    "the parameter server needs a constant float `learning_rate`. Pass a "
    "float to the optimizer and define "
    "`learning_rate_scheduler(model_version)` in the model zoo module to "
    "vary it during training."
)


class UnsupportedOptimizerError(UserError, ValueError):
    """The user's optimizer (class or option) cannot be run on the PS."""


@dataclass(frozen=True)
class OptimizerSpec:
    """What the PS needs to rebuild the user's optimizer.

    A class name and its Keras config (JSON-safe).
    """

    name: str  # one of SUPPORTED_OPTIMIZERS
    config: dict

    def to_json_dict(self) -> dict:
        """A JSON-serialisable dict; inverse of `from_json_dict`."""
        return {"name": self.name, "config": dict(self.config)}

    @classmethod
    def from_json_dict(cls, d: dict) -> OptimizerSpec:
        """Rebuild a spec from `to_json_dict()` output (e.g. after json.loads)."""
        if not isinstance(d, dict) or "name" not in d or "config" not in d:
            raise ValueError(
                f"an optimizer spec must be a dict with 'name' and 'config'; got {d!r}"
            )
        if not isinstance(d["config"], dict):
            raise TypeError(
                "optimizer spec 'config' must be a dict; "
                f"got {type(d['config']).__name__}"
            )
        return cls(name=str(d["name"]), config=dict(d["config"]))


def _jsonable(value: Any, key: str) -> Any:
    """Convert numpy scalars to Python ones; reject anything not JSON-safe."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key) for v in value]
    raise UnsupportedOptimizerError(
        f"optimizer option `{key}` is a {type(value).__name__}; the parameter "
        "server needs plain numbers here. Pass a constant float instead."
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _supported_names() -> str:
    """The Keras classes a model zoo may return, aliases included (AdamW as Adam)."""
    names = []
    for name in SUPPORTED_OPTIMIZERS:
        names.append(name)
        names += [alias for alias, target in _ALIASES.items() if target == name]
    return ", ".join(names)


def validate_config(name: str, config: dict) -> None:
    """Raise UnsupportedOptimizerError unless the PS can reproduce `config` exactly."""
    if name not in SUPPORTED_OPTIMIZERS:
        raise UnsupportedOptimizerError(
            f"optimizer {name!r} is not supported by the parameter server; it "
            f"supports {_supported_names()}."
        )
    lr = config.get("learning_rate", DEFAULTS[name]["learning_rate"])
    if isinstance(lr, dict):
        cls_name = lr.get("class_name", "a LearningRateSchedule")
        raise UnsupportedOptimizerError(
            f"{name}'s learning_rate is {cls_name} (a LearningRateSchedule); "
            + _LR_SCHEDULER_HINT
        )
    if not _is_number(lr):
        raise UnsupportedOptimizerError(
            f"{name}'s learning_rate is {type(lr).__name__}; " + _LR_SCHEDULER_HINT
        )
    for option, why in _UNSUPPORTED_OPTIONS.items():
        # Mirrors Keras, which treats 0/None/False as "off" for all of these.
        if config.get(option):
            raise UnsupportedOptimizerError(
                f"{name}({option}={config[option]!r}) is not supported by the "
                f"parameter server: {why}."
            )
    for option in ("weight_decay", "clipnorm", "clipvalue"):
        value = config.get(option)
        if value is not None and not _is_number(value):
            raise UnsupportedOptimizerError(
                f"{name}'s `{option}` must be a float or None; got {value!r}."
            )
    for option, default in DEFAULTS[name].items():
        value = config.get(option, default)
        ok = isinstance(value, bool) if option in _BOOL_OPTIONS else _is_number(value)
        if not ok:
            raise UnsupportedOptimizerError(
                f"{name}'s `{option}` must be a constant "
                f"{'bool' if option in _BOOL_OPTIONS else 'float'}; got {value!r}."
            )


def optimizer_spec_from_keras(optimizer: Any) -> OptimizerSpec:
    """Describe a Keras 3 optimizer for the PS, or explain why it cannot run there.

    Keras is deliberately not imported: the class is identified by name and
    module, and the hyperparameters come from ``get_config()``.
    """
    cls = type(optimizer)
    qualname = f"{cls.__module__}.{cls.__name__}"
    public = f"keras.optimizers.{cls.__name__}"
    supported = _supported_names()
    name = _ALIASES.get(cls.__name__, cls.__name__)
    if name not in SUPPORTED_OPTIMIZERS:
        raise UnsupportedOptimizerError(
            f"optimizer() returned "
            f"{public if cls.__module__.startswith('keras.') else qualname}; "
            f"the parameter server supports {supported}. Return one of those."
        )
    if cls.__module__.startswith("tf_keras."):
        return _spec_from_tf_keras(optimizer, name)
    if not cls.__module__.startswith("keras."):
        # A user class that merely shares the name (or a Keras 2 / tf_keras
        # optimizer) may do different math than we replicate.
        raise UnsupportedOptimizerError(
            f"optimizer() returned {qualname}, which is not Keras 3's own "
            f"{cls.__name__}; the parameter server supports {supported} from "
            "`keras.optimizers`. Return an instance of one of those."
        )

    # Check the learning rate before get_config(): Keras's get_config()
    # raises on a plain callable learning rate (it cannot serialize lambdas).
    lr_obj = getattr(optimizer, "_learning_rate", None)
    lr_mro = {c.__name__ for c in type(lr_obj).__mro__}
    if "LearningRateSchedule" in lr_mro:
        raise UnsupportedOptimizerError(
            f"{cls.__name__}'s learning_rate is {type(lr_obj).__name__} (a "
            "LearningRateSchedule); " + _LR_SCHEDULER_HINT
        )
    if callable(lr_obj) and "Variable" not in lr_mro:
        raise UnsupportedOptimizerError(
            f"{cls.__name__}'s learning_rate is a callable; " + _LR_SCHEDULER_HINT
        )
    # Keras applies weight decay to every variable unless the user called
    # exclude_from_weight_decay(); the PS only sees parameter names it was
    # never told to exclude, so refuse rather than decay the wrong variables.
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
        optimizer, "_exclude_from_weight_decay_pattern", None
    ):
        raise UnsupportedOptimizerError(
            f"{cls.__name__}.exclude_from_weight_decay() is not supported by the "
            "parameter server: weight decay is applied to every variable. "
            "Remove the call, or drop `weight_decay`."
        )

    config = _jsonable(optimizer.get_config(), "config")
    validate_config(name, config)
    return OptimizerSpec(name=name, config=config)


def _spec_from_tf_keras(optimizer: Any, name: str) -> OptimizerSpec:
    """A Keras 2 (``tf_keras``) optimizer, new or ``legacy``, as the spec of the same Keras 3 one.

    The update rules match for SGD and Adam; Keras 2's legacy Adagrad and RMSprop add epsilon
    outside the square root where Keras 3 adds it inside (a difference of order epsilon).
    """
    cls = type(optimizer)
    legacy = ".legacy." in cls.__module__
    lr_obj = getattr(optimizer, "_learning_rate", None)
    if legacy:
        lr_obj = getattr(optimizer, "_hyper", {}).get("learning_rate", lr_obj)
    if "LearningRateSchedule" in {c.__name__ for c in type(lr_obj).__mro__}:
        raise UnsupportedOptimizerError(
            f"{cls.__name__}'s learning_rate is {type(lr_obj).__name__} (a LearningRateSchedule); "
            + _LR_SCHEDULER_HINT
        )
    config = _jsonable(optimizer.get_config(), "config")
    if legacy:
        decay = config.pop("decay", 0.0)
        if decay:
            raise UnsupportedOptimizerError(
                f"{cls.__name__}(decay={decay}) is not supported by the parameter server: "
                + _LR_SCHEDULER_HINT
            )
    config.pop("is_legacy_optimizer", None)
    config.pop("jit_compile", None)
    validate_config(name, config)
    return OptimizerSpec(name=name, config=config)
