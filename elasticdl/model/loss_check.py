"""Does ``loss(labels, predictions)`` stretch the labels against the predictions?

An elementwise op between labels and predictions of different shapes broadcasts silently:
class ids of shape (N, 1) against logits of shape (N, 10) in a mean squared error compare
each id with all ten outputs, and labels of shape (N,) against outputs of shape (N, 1) make
an (N, N) matrix that mixes every example with every other. Training runs, and learns the
wrong thing.

``label_broadcast`` traces the loss once on the batch's shapes and looks at its graph for an
elementwise op (``Sub``, ``Mul``, ``SquaredDifference`` ...) that takes the labels themselves
(possibly cast, reshaped or squeezed) on one side and a tensor computed from the predictions
alone on the other, and stretches a dimension of either from 1 (or from nothing) to more.
Losses that use labels as indices (sparse categorical crossentropy with (N,) or (N, 1) ids
against (N, C) logits) or derive masks and weights from them are not flagged: only the raw
labels meeting the predictions count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Elementwise ops with numpy broadcasting.
_BROADCASTING_OPS = frozenset({
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "TruncateDiv", "FloorDiv",
    "FloorMod", "SquaredDifference", "Maximum", "Minimum", "Pow", "Xdivy", "Xlogy", "Xlog1py", "Atan2",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
})
# With a constant scalar on one side, these keep the labels' values one for one (2 * labels - 1).
_AFFINE = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div"})
# Ops after which a tensor still holds the labels' values, one for one.
_SAME_VALUES = frozenset({"Identity", "Cast", "Reshape", "ExpandDims", "Squeeze", "StopGradient", "Neg"})


@dataclass(frozen=True)
class LabelBroadcast:
    op: str
    labels_shape: tuple[int, ...]  # of the op's label-side input
    predictions_shape: tuple[int, ...]  # of its prediction-side input
    result_shape: tuple[int, ...]


def label_broadcast(loss_fn, labels: Any, predictions: Any) -> LabelBroadcast | None:
    """The first op of ``loss_fn``'s graph that broadcasts the labels against the predictions.

    None when there is none, or when the loss cannot be traced for the check (sparse or ragged
    values, Python-only code): the check then says nothing rather than guess.
    """
    import tensorflow as tf

    flat_labels, flat_predictions = tf.nest.flatten(labels), tf.nest.flatten(predictions)
    try:
        label_specs = [tf.TensorSpec(t.shape, t.dtype) for t in map(tf.convert_to_tensor, flat_labels)]
        prediction_specs = [tf.TensorSpec(t.shape, t.dtype) for t in map(tf.convert_to_tensor, flat_predictions)]

        def traced(label_list, prediction_list):
            return loss_fn(tf.nest.pack_sequence_as(labels, label_list),
                           tf.nest.pack_sequence_as(predictions, prediction_list))

        graph = tf.function(traced, autograph=False).get_concrete_function(label_specs, prediction_specs).graph
    except Exception:  # the loss ran eagerly already; a trace-only problem is not this check's to report
        return None
    inputs = graph.inputs
    label_inputs = {t.ref() for t in inputs[: len(label_specs)]}
    prediction_inputs = {t.ref() for t in inputs[len(label_specs): len(label_specs) + len(prediction_specs)]}
    raw_labels = set(label_inputs)  # tensors holding the labels' values as they are
    depends: dict = {}  # tensor -> {"labels", "predictions"} it is computed from
    for t in label_inputs:
        depends[t] = {"labels"}
    for t in prediction_inputs:
        depends[t] = {"predictions"}
    for op in graph.get_operations():
        if not op.inputs:
            continue  # the inputs themselves (placeholders), constants
        sources = set().union(*(depends.get(t.ref(), set()) for t in op.inputs))
        for out in op.outputs:
            depends[out.ref()] = sources
        if op.type in _SAME_VALUES and op.inputs and op.inputs[0].ref() in raw_labels:
            raw_labels.update(out.ref() for out in op.outputs)
        if op.type in _BROADCASTING_OPS and len(op.inputs) == 2:
            found = _stretched(op, raw_labels, depends)
            if found is not None:
                return found
            if op.type in _AFFINE and _labels_and_scalar(op, raw_labels, depends):  # 2 * labels - 1
                raw_labels.update(out.ref() for out in op.outputs)
    return None


def _labels_and_scalar(op, raw_labels: set, depends: dict) -> bool:
    a, b = op.inputs
    for label, other in ((a, b), (b, a)):
        if label.ref() in raw_labels and not depends.get(other.ref()) and other.shape.rank == 0:
            return True
    return False


def _stretched(op, raw_labels: set, depends: dict) -> LabelBroadcast | None:
    a, b = op.inputs
    if a.ref() in raw_labels and depends.get(b.ref()) == {"predictions"}:
        label, prediction = a, b
    elif b.ref() in raw_labels and depends.get(a.ref()) == {"predictions"}:
        label, prediction = b, a
    else:
        return None
    label_shape, prediction_shape = label.shape, prediction.shape
    if label_shape.rank is None or prediction_shape.rank is None or not label_shape.rank or not prediction_shape.rank:
        return None  # a scalar on either side (a statistic of the labels) broadcasts on purpose
    if not label_shape.is_fully_defined() or not prediction_shape.is_fully_defined():
        return None
    ls, ps = tuple(label_shape.as_list()), tuple(prediction_shape.as_list())
    rank = max(len(ls), len(ps))
    padded_l, padded_p = (1,) * (rank - len(ls)) + ls, (1,) * (rank - len(ps)) + ps
    result = tuple(max(x, y) for x, y in zip(padded_l, padded_p))
    if padded_l == result and padded_p == result:
        return None
    if any(min(x, y) != 1 and x != y for x, y in zip(padded_l, padded_p)):
        return None  # not broadcastable: the op itself fails
    return LabelBroadcast(op.type, ls, ps, result)
