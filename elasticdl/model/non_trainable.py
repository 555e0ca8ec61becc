"""Non-trainable state on the parameter servers: which variables, and what a worker sends.

A non-trainable variable (``BatchNormalization``'s moving mean and variance, the weights of a
frozen layer) is held by a PS like a trainable one (placed by the hash of its name, pulled,
snapshotted, checkpointed, exported) but changed by no optimizer: a training step changes it,
and the worker sends that change, ``new - old``, alongside its gradients.

Why the change and not the new value: the PS then combines both modes exactly. Sync mode
averages the changes of a version's pushes and adds the average; every push was computed on
that version's value, so this is the average of the workers' new values (a push that leaves a
variable out changed it by 0). Async mode adds each change as it comes, so no worker's update
overwrites another's. A new value would need the value it replaced to be applied in async.

Only float variables live on the PS: integer state (Keras's ``SeedGenerator`` counters) stays
with each worker, which is what makes the workers' dropout masks differ.

Pure numpy (no TensorFlow, no protobuf): the PS, the worker's client and the trainer share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NonTrainableChange:
    """How one step changed a non-trainable variable (``new - old``), where a gradient would be."""

    values: np.ndarray


def lives_on_ps(variable) -> bool:
    """Whether a non-trainable Keras variable is held by the parameter servers (float ones)."""
    return np.dtype(getattr(variable.dtype, "as_numpy_dtype", variable.dtype)).kind == "f"


def change_problem(name: str, change: np.ndarray, current: np.ndarray | None, non_trainable: bool) -> str:
    """Why ``change`` cannot be added to variable ``name`` ('' when it can): ``current`` is the
    variable's value on this PS (None: it holds no such variable)."""
    if current is None:
        return f"a change of unknown variable {name!r}: this PS does not hold it"
    if not non_trainable:
        return (f"a change of {name!r}, which is trainable: it moves by its gradient only "
                "(send the change of non-trainable variables alone)")
    if change.shape != current.shape:
        return f"the change of {name!r} has shape {change.shape}, the variable has {current.shape}"
    if change.dtype.kind != "f":
        return f"the change of {name!r} has dtype {change.dtype}, expected float"
    with np.errstate(over="ignore"):
        if not np.isfinite(change.astype(np.float32, copy=False)).all():
            return f"the change of {name!r} contains NaN or Inf (or a value beyond float32)"
    return ""
