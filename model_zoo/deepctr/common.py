"""What the click-through models share: the records, the loss, the metrics.

Records come from generate_data.py: ``ids`` (one int64 id per field, fields offset so they
never share an id) and ``label`` (0/1).
"""

import keras
import tensorflow as tf

from elasticdl import Mode

NUM_FIELDS = 8
_FEATURES = {
    "ids": tf.io.FixedLenFeature([NUM_FIELDS], tf.int64),
    "label": tf.io.FixedLenFeature([1], tf.int64),
}


def loss(labels, predictions):
    labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
    return tf.reduce_mean(keras.losses.binary_crossentropy(labels, tf.reshape(predictions, [-1])))


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        if mode == Mode.PREDICTION:
            return example["ids"]
        return example["ids"], example["label"]

    dataset = dataset.map(parse)
    if mode == Mode.TRAINING:
        dataset = dataset.shuffle(1024, seed=0)
    return dataset


def eval_metrics_fn():
    return {
        "auc": keras.metrics.AUC(num_thresholds=1000),
        "logloss": keras.metrics.BinaryCrossentropy(),
    }
