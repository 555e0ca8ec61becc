"""The TensorFlow side of a worker: datasets from raw records, gradients, parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from elasticdl.mode import Mode
from elasticdl.model_spec import DatasetMetadata, ModelSpec, ModelSpecError


def make_dataset(
    spec: ModelSpec,
    records: Sequence[bytes],
    mode: Mode,
    metadata: DatasetMetadata,
    batch_size: int,
) -> tf.data.Dataset:
    """Raw records -> the model zoo's ``dataset_fn`` -> batches."""
    raw = tf.data.Dataset.from_tensor_slices(tf.constant(list(records), dtype=tf.string))
    dataset = spec.dataset_fn(raw, mode, metadata)
    if not isinstance(dataset, tf.data.Dataset):
        raise ModelSpecError(
            f"{spec.module_path}: dataset_fn must return a tf.data.Dataset. "
            f"Received: {type(dataset).__name__}"
        )
    return dataset.batch(batch_size)


class Trainer:
    """A model built from the model zoo, with parameters set from and gradients sent to the PS."""

    def __init__(self, spec: ModelSpec, model_params: dict[str, Any]):
        self.spec = spec
        self.model = spec.build_model(model_params)
        self.variables: dict[str, tf.Variable] = {}
        self._local_optimizer = None
        self._train_step = tf.function(self._train_step_eager, reduce_retracing=True)

    @property
    def built(self) -> bool:
        return bool(self.variables)

    def ensure_built(self, features: Any) -> None:
        """Create the variables by calling the model once (subclassed models need a batch)."""
        if self.built:
            return
        if not self.model.built or not self.model.trainable_variables:
            self.model(features, training=False)
        variables = {}
        for var in self.model.trainable_variables:
            if var.path in variables:
                raise ModelSpecError(
                    f"{self.spec.module_path}: two trainable variables are named {var.path!r}; "
                    "give the layers distinct names."
                )
            variables[var.path] = var
        if not variables:
            raise ModelSpecError(f"{self.spec.module_path}: the model has no trainable variables.")
        self.variables = variables

    def get_params(self) -> dict[str, np.ndarray]:
        return {name: var.numpy() for name, var in self.variables.items()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        for name, value in params.items():
            var = self.variables.get(name)
            if var is None:
                raise ModelSpecError(
                    f"the parameter server holds {name!r}, which this model does not have: "
                    "was the checkpoint made by a different model?"
                )
            var.assign(value)

    def apply_locally(self, grads: dict[str, np.ndarray], learning_rate: float | None) -> None:
        """Async with --get_model_steps > 1: train on our own updates until the next pull."""
        if self._local_optimizer is None:
            self._local_optimizer = self.spec.optimizer()
        if learning_rate:
            self._local_optimizer.learning_rate = learning_rate
        self._local_optimizer.apply_gradients(
            [(tf.convert_to_tensor(grads[name]), var) for name, var in self.variables.items() if name in grads]
        )

    def compute_gradients(self, features: Any, labels: Any) -> tuple[float, dict[str, np.ndarray]]:
        loss, grads = self._train_step(features, labels)
        names = list(self.variables)
        return float(loss), {
            name: grad.numpy() for name, grad in zip(names, grads) if grad is not None
        }

    def _train_step_eager(self, features, labels):
        with tf.GradientTape() as tape:
            predictions = self.model(features, training=True)
            loss = self.spec.loss(labels, predictions)
            if self.model.losses:
                loss += tf.add_n(self.model.losses)
        grads = tape.gradient(loss, list(self.variables.values()))
        return loss, [tf.convert_to_tensor(g) if g is not None else None for g in grads]
