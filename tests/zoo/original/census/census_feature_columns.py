"""Shared by the census modules (``from model_zoo.census.census_feature_columns import``), as
the original's census_feature_columns.py: numeric columns and ElasticDL's embedding columns."""

import tensorflow as tf

from elasticdl.python.common.constants import Mode
from elasticdl.python.elasticdl.feature_column import feature_column

NUMERIC = ["age", "hours"]
CATEGORICAL = ["workclass", "education"]
LABEL_KEY = "label"


def get_feature_columns():
    columns = [tf.feature_column.numeric_column(key) for key in NUMERIC]
    for key in CATEGORICAL:
        columns.append(feature_column.embedding_column(
            tf.feature_column.categorical_column_with_hash_bucket(key, hash_bucket_size=16), dimension=4))
    return columns


def get_feature_input_layers():
    layers = {key: tf.keras.Input(shape=(1,), name=key, dtype=tf.float32) for key in NUMERIC}
    layers.update({key: tf.keras.Input(shape=(1,), name=key, dtype=tf.string) for key in CATEGORICAL})
    return layers


def loss(labels, predictions):
    labels = tf.cast(tf.reshape(labels, [-1, 1]), tf.float32)
    return tf.reduce_mean(tf.keras.losses.binary_crossentropy(labels, predictions))


def optimizer(lr=0.05):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def eval_metrics_fn():
    return {"accuracy": tf.keras.metrics.BinaryAccuracy(), "auc": tf.keras.metrics.AUC()}


def dataset_fn(dataset, mode, _):
    spec = {key: tf.io.FixedLenFeature([1], tf.float32) for key in NUMERIC}
    spec.update({key: tf.io.FixedLenFeature([1], tf.string) for key in CATEGORICAL})
    spec[LABEL_KEY] = tf.io.FixedLenFeature([1], tf.int64)

    def parse(record):
        r = tf.io.parse_single_example(record, spec)
        label = r.pop(LABEL_KEY)
        return r if mode == Mode.PREDICTION else (r, label)

    return dataset.map(parse)
