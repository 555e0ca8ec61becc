"""Class weights as ``model.fit(class_weight=...)`` takes them: each training example gets the
weight of its class as its sample weight (elasticdl/model/sample_weight.py), computed from its
label as Keras computes it.

The classes: a label of rank 1 (or a trailing dimension of 1) holds the class id (rounded);
a label whose last dimension is wider is one-hot (or probabilities), its class the argmax.
A class the dict does not name weighs 1, as in Keras. Only training examples are weighted;
evaluation metrics are not (Keras's ``validation_data`` is not weighted by ``class_weight``).
"""

from __future__ import annotations

from elasticdl.model.spec import CLASS_WEIGHT_FUNCTION as FUNCTION
from elasticdl.model.spec import ModelSpecError


def add_class_weights(dataset, class_weight: dict[int, float], module_path: str):
    """``dataset`` of (features, labels) with each example's class weight as a third element."""
    import tensorflow as tf

    table = tf.constant([class_weight.get(c, 1.0) for c in range(max(class_weight) + 1)], tf.float32)

    _check_element(dataset.element_spec, module_path)

    def weigh(features, labels):
        classes = _classes(labels)
        known = tf.logical_and(classes >= 0, classes < tf.shape(table)[0])
        weight = tf.gather(table, tf.clip_by_value(classes, 0, tf.shape(table)[0] - 1))
        return features, labels, tf.where(known, weight, 1.0)  # a class not named weighs 1

    return dataset.map(weigh)


def _check_element(spec, module_path: str) -> None:
    """(features, labels) with one label tensor: checked on the dataset's element spec, before
    any tracing (an error raised in a traced function reaches the user wrapped)."""
    import tensorflow as tf

    if not isinstance(spec, tuple) or len(spec) != 2:
        found = f"{len(spec)} elements" if isinstance(spec, tuple) else "one element"
        raise ModelSpecError(
            f"{module_path}: class weights (--class_weight or {FUNCTION}()) make each example's sample "
            f"weight, and dataset_fn yields {found} per example: yield (features, labels) pairs, or drop "
            "the class weights and weigh the examples in dataset_fn's sample_weight (Keras refuses "
            "class_weight with sample_weight too)."
        )
    if not isinstance(spec[1], tf.TensorSpec):
        raise ModelSpecError(
            f"{module_path}: class weights (--class_weight or {FUNCTION}()) need one label tensor per "
            f"example (a single output), and dataset_fn's labels are a {type(spec[1]).__name__}: drop the "
            "class weights and yield (features, labels, sample_weight), the weight computed from the label "
            "that counts (Keras refuses class_weight for several outputs too)."
        )


def _classes(labels):
    """An example's class id from its label, as Keras's class_weight does (per example here:
    Keras looks at the batch, whose rank is one more)."""
    import tensorflow as tf

    if labels.shape.rank == 0:
        return tf.cast(tf.round(tf.cast(labels, tf.float32)), tf.int32)

    def class_id():
        return tf.cast(tf.round(tf.cast(tf.squeeze(labels, -1), tf.float32)), tf.int32)

    def one_hot():
        return tf.argmax(labels, axis=-1, output_type=tf.int32)

    width = labels.shape[-1]
    if width is None:
        return tf.cond(tf.shape(labels)[-1] > 1, one_hot, class_id)
    return one_hot() if width > 1 else class_id()
