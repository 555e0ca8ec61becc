"""One PS shard of the model: dense variables, their optimizer slots, and the model version."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elasticdl.ps.optimizers import Optimizer


class GradientError(ValueError):
    """A pushed gradient that cannot be applied; the shard is left unchanged."""


@dataclass
class ParameterShard:
    optimizer: Optimizer
    params: dict[str, np.ndarray] = field(default_factory=dict)
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    version: int = 0
    # Optimizer applies so far (Keras's `iterations`); Adam's bias correction needs it.
    step: int = 0
    initialized: bool = False

    def initialize(self, params: dict[str, np.ndarray], version: int = 0) -> bool:
        """Take the first model pushed to this shard; later pushes are ignored (False)."""
        if self.initialized:
            return False
        self.params = {name: np.array(value, dtype=np.float32) for name, value in params.items()}
        self.slots = {name: self.optimizer.create_slots(value) for name, value in self.params.items()}
        self.version = version
        self.initialized = True
        return True

    def check_gradients(self, grads: dict[str, np.ndarray]) -> None:
        """Raise GradientError naming the first gradient that does not fit this shard."""
        if not self.initialized:
            raise GradientError("the parameter server holds no model yet; push the model first")
        for name, grad in grads.items():
            param = self.params.get(name)
            if param is None:
                raise GradientError(f"unknown variable {name!r}: this PS does not hold it")
            if grad.shape != param.shape:
                raise GradientError(
                    f"gradient for {name!r} has shape {grad.shape}, the variable has {param.shape}"
                )
            if grad.dtype.kind != "f":
                raise GradientError(f"gradient for {name!r} has dtype {grad.dtype}, expected float")
            if not np.isfinite(grad).all():
                raise GradientError(f"gradient for {name!r} contains NaN or Inf")

    def apply(self, grads: dict[str, np.ndarray], learning_rate: float | None) -> None:
        """One optimizer step over the given gradients; the version goes up by one."""
        self.step += 1
        for name, grad in grads.items():
            self.optimizer.apply(
                self.params[name],
                np.asarray(grad, dtype=np.float32),
                self.slots[name],
                self.step,
                learning_rate,
            )
        self.version += 1
