"""One PS shard of the model: dense variables (trainable and non-trainable), embedding tables,
optimizer slots, the model version."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elasticdl.errors import JobFailure
from elasticdl.model.embedding.table import EmbeddingError, EmbeddingTable, IndexedRows, TableInfo, check_rows
from elasticdl.model.non_trainable import NonTrainableChange, change_problem
from elasticdl.model.optimizers import Optimizer
from elasticdl.ps.square_sums import cleared_square_sum


class GradientError(JobFailure, ValueError):
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
    # Embedding tables: this PS holds the rows whose id % num_ps == ps_id.
    embeddings: dict[str, EmbeddingTable] = field(default_factory=dict)
    ps_id: int = 0
    num_ps: int = 1
    # The names in `params` that are non-trainable state: no slots, changed by pushed
    # NonTrainableChange only (elasticdl/model/non_trainable.py).
    non_trainable: frozenset = frozenset()

    def initialize(self, params: dict[str, np.ndarray], version: int = 0, non_trainable=()) -> bool:
        """Take the first model pushed to this shard; later pushes are ignored (False).
        ``non_trainable``: the names of ``params`` that are non-trainable state."""
        if self.initialized:
            return False
        self.params = {name: np.array(value, dtype=np.float32) for name, value in params.items()}
        self.non_trainable = frozenset(non_trainable) & frozenset(self.params)
        self.slots = {name: self.optimizer.create_slots(value) for name, value in self.params.items()
                      if name not in self.non_trainable}
        self.version = version
        self.initialized = True
        return True

    def add_tables(self, infos: list[TableInfo]) -> list[str]:
        """Create the tables not held yet (names returned); a known name must keep its dim."""
        for info in infos:
            held = self.embeddings.get(info.name)
            if held is not None and held.dim != info.dim:
                raise EmbeddingError(
                    f"embedding table {info.name!r} has rows of width {held.dim} on the parameter server, "
                    f"the model's layer has {info.dim}: was the model changed since the checkpoint was made?"
                )
        for info in infos:
            held = self.embeddings.get(info.name)
            if held is not None and held.policy != info.policy:  # the job's settings now (a resumed job)
                held.set_policy(info.policy)
        added = [info for info in infos if info.name not in self.embeddings]
        for info in added:
            self.embeddings[info.name] = EmbeddingTable(info, self.optimizer)
            self.embeddings[info.name].version = self.version
        return [info.name for info in added]

    def table(self, name: str) -> EmbeddingTable:
        table = self.embeddings.get(name)
        if table is None:
            known = ", ".join(sorted(self.embeddings)) or "none"
            raise EmbeddingError(f"unknown embedding table {name!r} (this PS holds: {known})")
        return table

    def check_gradients(self, grads: dict[str, np.ndarray | IndexedRows]) -> None:
        """Raise GradientError (EmbeddingError for rows) naming the first gradient that does not fit."""
        if not self.initialized:
            raise GradientError("the parameter server holds no model yet; push the model first")
        for name, grad in grads.items():
            if isinstance(grad, IndexedRows):
                check_rows(name, grad, self.table(name).dim, self.ps_id, self.num_ps)
                continue
            param = self.params.get(name)
            if isinstance(grad, NonTrainableChange):
                problem = change_problem(name, grad.values, param, name in self.non_trainable)
                if problem:
                    raise GradientError(problem)
                continue
            if param is None:
                raise GradientError(f"unknown variable {name!r}: this PS does not hold it")
            if name in self.non_trainable:
                raise GradientError(
                    f"a gradient for {name!r}, which is non-trainable: the PS changes it by the pushed "
                    "change of each step (non_trainable_changes), never by a gradient"
                )
            if grad.shape != param.shape:
                raise GradientError(
                    f"gradient for {name!r} has shape {grad.shape}, the variable has {param.shape}"
                )
            if grad.dtype.kind != "f":
                raise GradientError(f"gradient for {name!r} has dtype {grad.dtype}, expected float")
            # One BLAS pass clears a finite gradient; only one it does not is looked at value by value.
            if cleared_square_sum(grad) is None and not np.isfinite(grad).all():
                raise GradientError(f"gradient for {name!r} contains NaN or Inf")
        if all(isinstance(g, NonTrainableChange) for g in grads.values()):
            trainable = sorted(n for n in self.params if n not in self.non_trainable)
        else:
            trainable = []
        if trainable:
            # Only a PS with no trainable dense variable gets empty pushes from a worker (a batch
            # without ids of its tables): they keep versions in step. Here one would count as a
            # whole gradient of zeros (docs/consistency.md, "What a push carries").
            raise GradientError(
                f"an empty push: this PS holds {len(trainable)} trainable dense variables "
                f"({', '.join(trainable[:3])}{', ...' if len(trainable) > 3 else ''}) "
                "and the push carries a gradient for none of them; does the loss depend on them?"
            )

    def apply(self, grads: dict[str, np.ndarray], learning_rate: float | None) -> None:
        """One optimizer step over the given gradients (and the non-trainable changes added);
        the version goes up by one."""
        self.step += 1
        for name, grad in grads.items():
            if isinstance(grad, IndexedRows):
                self.embeddings[name].apply(grad, self.step, learning_rate, self.version + 1)  # sums repeats
                continue
            if isinstance(grad, NonTrainableChange):
                self.params[name] += np.asarray(grad.values, dtype=np.float32)
                continue
            self.optimizer.apply(
                self.params[name],
                np.asarray(grad, dtype=np.float32),
                self.slots[name],
                self.step,
                learning_rate,
            )
        self.version += 1
        for table in self.embeddings.values():  # expiry moves with the version (table.advance)
            table.advance(self.version)
