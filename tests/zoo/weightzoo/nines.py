"""Is this digit a 9? From the top two rows of pixels only, with a linear model: the features
say little, so the class weights decide much of what it predicts (1 in 10 digits is a 9).
For the class-weight tests: --class_weight, or the module function class_weight() in
nines_weighted.py."""

import keras
import tensorflow as tf

from elasticdl import Mode

_FEATURES = {
    "image": tf.io.FixedLenFeature([64], tf.float32),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}


def custom_model():
    inputs = keras.Input(shape=(16,), name="top_rows")
    return keras.Model(inputs, keras.layers.Dense(2, name="logits")(inputs))


def loss(labels, predictions):  # per example, so that it can be weighted
    return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)


def optimizer(lr=0.05):
    return keras.optimizers.SGD(learning_rate=lr)


def parse(record):
    example = tf.io.parse_single_example(record, _FEATURES)
    return example["image"][:16], tf.cast(tf.equal(example["label"], 9), tf.int64)


def dataset_fn(dataset, mode, metadata):
    dataset = dataset.map(parse)
    if mode == Mode.PREDICTION:
        return dataset.map(lambda features, label: features)
    return dataset


def mean_p_nine(labels, predictions):
    """The predicted probability of a 9, per example: how far the class weights pull the model."""
    return tf.nn.softmax(predictions)[:, 1]


def eval_metrics_fn():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(), "mean_p_nine": mean_p_nine}
