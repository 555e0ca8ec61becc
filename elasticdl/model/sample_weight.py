"""Sample weights as ``model.fit`` takes them: a ``dataset_fn`` may yield
``(features, labels, sample_weight)``, and the loss and the metrics weigh each example by it.

The loss follows Keras's ``sum_over_batch_size`` reduction: the per-example losses times their
weights, summed, divided by the number of loss values (not by the sum of the weights), so a
weight of 2 counts an example twice and a weight of 0 drops it. A model-zoo ``loss`` that takes
a ``sample_weight`` argument (every ``keras.losses.Loss`` object does) is handed the weights
and reduces them itself, exactly as ``model.fit`` calls it. A loss that returns one value per
example is weighted here. A loss that returns a scalar cannot be weighted (the examples are
already averaged together): it is refused with the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from elasticdl.model.spec import ModelSpecError


class Batch(NamedTuple):
    """One element (or batch) of ``dataset_fn``'s dataset in training or evaluation."""

    features: Any
    labels: Any
    sample_weight: Any = None  # None: every example weighs 1


def unpack(element: Any, spec: Any, mode: Any) -> Batch:
    """``(features, labels)`` or ``(features, labels, sample_weight)``, as Keras unpacks ``fit``'s
    data; ``spec`` (a ModelSpec) names the module in the error."""
    if isinstance(element, tuple) and len(element) in (2, 3):
        return Batch(*element)
    module_path = getattr(spec, "module_path", "the model-zoo module")
    received = f"a tuple of {len(element)}" if isinstance(element, tuple) else type(element).__name__
    raise ModelSpecError(
        f"{module_path}: in {mode} mode dataset_fn must yield (features, labels) pairs or "
        f"(features, labels, sample_weight) triples. Received elements of type {received}"
    )


def features_of(element: Any) -> Any:
    """The features of a prediction-mode element: a dataset_fn may yield its labels (and weights) too."""
    if isinstance(element, tuple) and len(element) in (2, 3):
        return element[0]
    return element


def takes_sample_weight(fn: Callable) -> bool:
    """Whether ``fn(labels, predictions, sample_weight=...)`` can be called (Keras Loss objects can)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "sample_weight" or p.kind == p.VAR_KEYWORD for p in params)


def weighted_loss(loss: Callable, labels: Any, predictions: Any, sample_weight: Any, module_path: str = "") -> Any:
    """``loss(labels, predictions)`` with each example weighted by ``sample_weight``, as
    ``model.fit`` computes it; ``loss(labels, predictions)`` when there are no weights.

    ``loss`` is the spec's loss: the mean of per-example values, with the user's function as
    ``__wrapped__`` (elasticdl/model/spec.py)."""
    if sample_weight is None:
        return loss(labels, predictions)
    import tensorflow as tf

    raw = getattr(loss, "__wrapped__", loss)
    if takes_sample_weight(raw):
        return raw(labels, predictions, sample_weight=sample_weight)
    if isinstance(sample_weight, (dict, list)):
        raise ModelSpecError(
            f"{module_path}: dataset_fn yields a sample_weight per output ({type(sample_weight).__name__}), "
            f"and {_name(raw)}(labels, predictions) takes no sample_weight argument to weigh each output's "
            f"examples: give {_name(raw)} a sample_weight parameter, or yield one weight tensor per example."
        )
    values = tf.convert_to_tensor(raw(labels, predictions))
    if values.shape.rank == 0:
        raise ModelSpecError(
            f"{module_path}: dataset_fn yields (features, labels, sample_weight), but "
            f"{_name(raw)}(labels, predictions) returns a scalar, so its examples cannot be weighted. "
            "Return one loss value per example (drop the tf.reduce_mean: ElasticDL weighs and averages "
            "them as model.fit does), or take a sample_weight argument, e.g. "
            "keras.losses.SparseCategoricalCrossentropy()(labels, predictions, sample_weight)."
        )
    weights = _same_rank(tf.cast(sample_weight, values.dtype), values.shape.rank)
    # Keras's sum_over_batch_size: divided by the number of values, not by the weights' sum.
    return tf.reduce_sum(values * weights) / tf.cast(tf.size(values), values.dtype)


def weighted_values(values: Any, sample_weight: Any) -> tuple[float, float]:
    """(sum of values x weights, sum of weights) of a metric function's per-example values:
    its weighted mean as Keras's ``MeanMetricWrapper`` takes it."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    if sample_weight is None or values.ndim == 0:  # a scalar is the batch's own summary: one value
        return float(values.sum()), float(values.size)
    weights = np.asarray(sample_weight, dtype=np.float64)
    while weights.ndim > values.ndim and weights.shape[-1] == 1:
        weights = weights.reshape(weights.shape[:-1])
    weights = weights.reshape(weights.shape + (1,) * (values.ndim - weights.ndim))
    weights = np.broadcast_to(weights, values.shape)
    return float((values * weights).sum()), float(weights.sum())


def for_output(sample_weight: Any, output: str | None) -> Any:
    """The weights of one output's metrics: its entry of a per-output dict, else the same weights."""
    if isinstance(sample_weight, dict) and output is not None:
        return sample_weight.get(output)
    return sample_weight


def _same_rank(weights, rank: int):
    """Weights of shape (batch,) or (batch, 1) against loss values of ``rank``, as Keras's
    squeeze_or_expand_to_same_rank lines them up."""
    import tensorflow as tf

    while weights.shape.rank > rank and weights.shape[-1] == 1:
        weights = tf.squeeze(weights, -1)
    while weights.shape.rank < rank:
        weights = tf.expand_dims(weights, -1)
    return weights


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__
