"""A digits model whose dataset_fn yields (features, labels, sample_weight), as model.fit takes
them: odd digits weigh 3, even ones 1. Its loss returns one value per example."""

import keras
import tensorflow as tf

from elasticdl import Mode

_FEATURES = {
    "image": tf.io.FixedLenFeature([64], tf.float32),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}


def weight_of(label):
    """The weight of an example of class ``label`` (numpy or tensor)."""
    return 1.0 + 2.0 * (label % 2.0)


def custom_model():
    inputs = keras.Input(shape=(64,), name="image")
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(hidden))


def loss(labels, predictions):  # per example: ElasticDL weighs them as model.fit does
    return keras.losses.sparse_categorical_crossentropy(tf.reshape(labels, [-1]), predictions, from_logits=True)


def optimizer(lr=0.05):  # the weights average 2: half the unweighted digits model's rate takes its step size
    return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        if mode == Mode.PREDICTION:
            return example["image"]
        label = example["label"]
        return example["image"], label, weight_of(tf.cast(label[0], tf.float32))

    return dataset.map(parse)


def _correct(labels, predictions):
    return tf.cast(tf.equal(tf.reshape(labels, [-1]), tf.argmax(predictions, axis=1)), tf.float32)


def eval_metrics_fn():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy(), "fn_accuracy": _correct}
