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

import numpy as np

from elasticdl.model.optimizer_spec import (  # noqa: F401  (re-exported: callers import them from here)
    DEFAULTS,
    MAX_LEARNING_RATE,
    SUPPORTED_OPTIMIZERS,
    OptimizerSpec,
    UnsupportedOptimizerError,
    learning_rate_problem,
    optimizer_spec_from_keras,
    validate_config,
)

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


class Optimizer(ABC):
    """Applies one Keras optimizer's update to numpy float32 arrays, in place.

    Stateless apart from the spec: ``create_slots`` returns the per-parameter
    state, which the caller stores and passes back to ``apply``.
    """

    slot_names: tuple[str, ...]
    learning_rate: float

    def __init__(self, spec: OptimizerSpec) -> None:
        validate_config(spec.name, spec.config)
        self.spec = spec
        cfg = {**DEFAULTS[spec.name], **spec.config}
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
    validate_config(spec.name, spec.config)
    return _CLASSES[spec.name](spec)
