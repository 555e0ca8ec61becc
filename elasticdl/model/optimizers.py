"""Keras-3-compatible optimizers for the parameter server, in pure numpy.

The PS must not import TensorFlow or Keras, yet a model trained through it
must follow the same trajectory as ``model.fit`` with the user's optimizer.
So each class here re-implements one Keras 3 ``update_step`` (plus the base
optimizer's per-variable clipping and decoupled weight decay) on float32
numpy arrays, in place.

Optimizer state ("slots": momentums, velocities, accumulators) is owned by
the caller and stored next to each parameter, so one ``Optimizer`` instance
serves every parameter (and every row subset of an embedding table) on a PS.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from elasticdl.errors import UserError

__all__ = [
    "SGD",
    "SUPPORTED_OPTIMIZERS",
    "Adagrad",
    "Adam",
    "MAX_LEARNING_RATE",
    "Optimizer",
    "OptimizerSpec",
    "RMSprop",
    "UnsupportedOptimizerError",
    "learning_rate_problem",
    "make_optimizer",
    "optimizer_spec_from_keras",
]

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
_DEFAULTS: dict[str, dict[str, Any]] = {
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


def _validate_config(name: str, config: dict) -> None:
    """Raise UnsupportedOptimizerError unless the PS can reproduce `config` exactly."""
    if name not in SUPPORTED_OPTIMIZERS:
        raise UnsupportedOptimizerError(
            f"optimizer {name!r} is not supported by the parameter server; it "
            f"supports {_supported_names()}."
        )
    lr = config.get("learning_rate", _DEFAULTS[name]["learning_rate"])
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
    for option, default in _DEFAULTS[name].items():
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
    _validate_config(name, config)
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
    _validate_config(name, config)
    return OptimizerSpec(name=name, config=config)


class Optimizer(ABC):
    """Applies one Keras optimizer's update to numpy float32 arrays, in place.

    Stateless apart from the spec: ``create_slots`` returns the per-parameter
    state, which the caller stores and passes back to ``apply``.
    """

    slot_names: tuple[str, ...]
    learning_rate: float

    def __init__(self, spec: OptimizerSpec) -> None:
        _validate_config(spec.name, spec.config)
        self.spec = spec
        cfg = {**_DEFAULTS[spec.name], **spec.config}
        self._cfg = cfg
        self.learning_rate = float(cfg["learning_rate"])
        wd = cfg.get("weight_decay")
        self._weight_decay = None if wd is None else np.float32(wd)
        clipnorm, clipvalue = cfg.get("clipnorm"), cfg.get("clipvalue")
        # Keras: `if self.clipnorm and self.clipnorm > 0`, then clipvalue.
        self._clipnorm = float(clipnorm) if clipnorm and clipnorm > 0 else None
        self._clipvalue = (
            float(clipvalue)
            if self._clipnorm is None and clipvalue and clipvalue > 0
            else None
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.config!r})"

    def create_slots(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh optimizer state for `param` (or for a block of its rows), float32."""
        return {
            name: np.full(param.shape, self._slot_initial_value(name), np.float32)
            for name in self.slot_names
        }

    def _slot_initial_value(self, name: str) -> float:
        return 0.0

    def apply(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        step: int,
        learning_rate: float | None = None,
    ) -> None:
        """Update `param` and `slots` in place with `grad`.

        `step` is 1 for the first update (Keras's ``iterations + 1``).
        `learning_rate` overrides the spec's for this call (and, as in Keras,
        also scales weight decay). Any shape works as long as `grad` and every
        slot match `param`, so gathered embedding rows can be updated too.
        """
        if param.dtype != np.float32:
            raise TypeError(f"parameters must be float32, got {param.dtype}")
        grad = np.asarray(grad, dtype=np.float32)  # Keras casts grads to the var dtype
        if grad.shape != param.shape:
            raise ValueError(
                f"gradient shape {grad.shape} does not match "
                f"parameter shape {param.shape}"
            )
        if step < 1:
            raise ValueError(f"step must be >= 1 (1 for the first update); got {step}")
        lr = np.float32(self.learning_rate if learning_rate is None else learning_rate)

        grad = self._clip(grad)
        # One scratch buffer per call, shared by weight decay and the update,
        # keeps the hot path at a single grad-sized allocation.
        tmp = np.empty_like(param)
        if self._weight_decay is not None:
            # Decoupled, before the update, with the current lr:
            # var -= var * wd * lr (base_optimizer._apply_weight_decay).
            np.multiply(param, self._weight_decay, out=tmp)
            tmp *= lr
            param -= tmp
        self._update(param, grad, slots, step, lr, tmp)

    def _clip(self, grad: np.ndarray) -> np.ndarray:
        """Keras's per-variable clipnorm / clipvalue; a new array if it clips."""
        if self._clipnorm is not None:
            # tf.clip_by_norm: g * c / max(||g||, c). When ||g|| <= c that is g
            # up to rounding, so skip the copy.
            l2 = math.sqrt(float(np.vdot(grad, grad)))
            if l2 > self._clipnorm:
                clipped = np.multiply(grad, np.float32(self._clipnorm))
                clipped /= np.float32(l2)
                return clipped
        elif self._clipvalue is not None:
            return np.clip(grad, -self._clipvalue, self._clipvalue)
        return grad

    @abstractmethod
    def _update(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, np.ndarray],
        step: int,
        lr: np.float32,
        tmp: np.ndarray,
    ) -> None:
        """The optimizer's update_step; `tmp` is scratch space shaped like `param`."""


class SGD(Optimizer):
    """keras.optimizers.SGD: plain, momentum and Nesterov."""

    def __init__(self, spec: OptimizerSpec) -> None:
        super().__init__(spec)
        self._momentum = np.float32(self._cfg["momentum"])
        self._nesterov = bool(self._cfg["nesterov"])
        # Keras only creates the momentum slot when momentum != 0.
        self.slot_names = ("momentum",) if self._cfg["momentum"] != 0 else ()

    def _update(self, param, grad, slots, step, lr, tmp) -> None:
        np.multiply(grad, lr, out=tmp)  # g * lr
        if not self.slot_names:
            param -= tmp
            return
        m = slots["momentum"]
        m *= self._momentum  # m = m * momentum - g * lr
        m -= tmp
        if self._nesterov:
            # var += m * momentum - g * lr
            param -= tmp
            np.multiply(m, self._momentum, out=tmp)
            param += tmp
        else:
            param += m


class Adam(Optimizer):
    """keras.optimizers.Adam (and AdamW, which is Adam plus weight_decay)."""

    def __init__(self, spec: OptimizerSpec) -> None:
        super().__init__(spec)
        cfg = self._cfg
        self._beta_1 = np.float32(cfg["beta_1"])
        self._beta_2 = np.float32(cfg["beta_2"])
        # Keras computes `1 - self.beta_1` on Python floats, then casts.
        self._one_minus_beta_1 = np.float32(1 - cfg["beta_1"])
        self._one_minus_beta_2 = np.float32(1 - cfg["beta_2"])
        self._epsilon = np.float32(cfg["epsilon"])
        self._amsgrad = bool(cfg["amsgrad"])
        self.slot_names = ("momentum", "velocity") + (
            ("velocity_hat",) if self._amsgrad else ()
        )

    def _update(self, param, grad, slots, step, lr, tmp) -> None:
        one = np.float32(1)
        t = np.float32(step)
        # Bias correction folded into the step size, all in float32 like Keras.
        alpha = lr * np.sqrt(one - self._beta_2**t) / (one - self._beta_1**t)
        m, v = slots["momentum"], slots["velocity"]
        np.subtract(grad, m, out=tmp)  # m += (g - m) * (1 - beta_1)
        tmp *= self._one_minus_beta_1
        m += tmp
        np.square(grad, out=tmp)  # v += (g^2 - v) * (1 - beta_2)
        tmp -= v
        tmp *= self._one_minus_beta_2
        v += tmp
        if self._amsgrad:
            v_hat = slots["velocity_hat"]
            np.maximum(v_hat, v, out=v_hat)
            v = v_hat
        # var -= m * alpha / (sqrt(v) + eps)
        np.sqrt(v, out=tmp)
        tmp += self._epsilon
        np.divide(m, tmp, out=tmp)
        tmp *= alpha
        param -= tmp


class Adagrad(Optimizer):
    """keras.optimizers.Adagrad."""

    slot_names = ("accumulator",)

    def __init__(self, spec: OptimizerSpec) -> None:
        super().__init__(spec)
        self._initial = float(self._cfg["initial_accumulator_value"])
        self._epsilon = np.float32(self._cfg["epsilon"])

    def _slot_initial_value(self, name: str) -> float:
        return self._initial

    def _update(self, param, grad, slots, step, lr, tmp) -> None:
        acc = slots["accumulator"]
        np.square(grad, out=tmp)  # acc += g^2
        acc += tmp
        # var -= lr * g / sqrt(acc + eps)  (eps inside the sqrt, as in Keras)
        np.add(acc, self._epsilon, out=tmp)
        np.sqrt(tmp, out=tmp)
        np.divide(grad, tmp, out=tmp)
        tmp *= lr
        param -= tmp


class RMSprop(Optimizer):
    """keras.optimizers.RMSprop: plain, momentum and centered."""

    def __init__(self, spec: OptimizerSpec) -> None:
        super().__init__(spec)
        cfg = self._cfg
        self._rho = np.float32(cfg["rho"])
        self._one_minus_rho = np.float32(1 - cfg["rho"])
        self._momentum = np.float32(cfg["momentum"])
        self._epsilon = np.float32(cfg["epsilon"])
        self._centered = bool(cfg["centered"])
        # Keras creates the momentum slot only when momentum > 0.
        self._use_momentum = cfg["momentum"] > 0
        self.slot_names = (
            ("velocity",)
            + (("momentum",) if self._use_momentum else ())
            + (("average_gradient",) if self._centered else ())
        )

    def _update(self, param, grad, slots, step, lr, tmp) -> None:
        vel = slots["velocity"]
        vel *= self._rho  # vel = rho * vel + (1 - rho) * g^2
        np.square(grad, out=tmp)
        tmp *= self._one_minus_rho
        vel += tmp
        if self._centered:
            avg = slots["average_gradient"]
            avg *= self._rho  # avg = rho * avg + (1 - rho) * g
            np.multiply(grad, self._one_minus_rho, out=tmp)
            avg += tmp
            np.square(avg, out=tmp)  # denominator = vel - avg^2 + eps
            np.subtract(vel, tmp, out=tmp)
        else:
            np.copyto(tmp, vel)  # denominator = vel + eps
        tmp += self._epsilon
        # increment = lr * g / sqrt(denominator)
        np.sqrt(tmp, out=tmp)
        np.divide(grad, tmp, out=tmp)
        tmp *= lr
        if self._use_momentum:
            mom = slots["momentum"]
            mom *= self._momentum  # mom = momentum * mom + increment
            mom += tmp
            param -= mom
        else:
            param -= tmp


_CLASSES: dict[str, type[Optimizer]] = {
    "SGD": SGD,
    "Adam": Adam,
    "Adagrad": Adagrad,
    "RMSprop": RMSprop,
}


def make_optimizer(spec: OptimizerSpec) -> Optimizer:
    """Build the numpy optimizer for `spec`; UnsupportedOptimizerError if impossible."""
    _validate_config(spec.name, spec.config)
    return _CLASSES[spec.name](spec)
