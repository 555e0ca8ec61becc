"""Written as the original's census_dnn_model is: feature columns (numeric, hashed categorical
through ElasticDL's embedding_column, its rows on the PS), DenseFeatures on a dict of Inputs,
function names given by flags (--feed, --loss, --optimizer, --eval_metrics_fn), a logger from
the original's log_utils."""

import tensorflow as tf

from elasticdl.python.common.constants import Mode
from elasticdl.python.common.log_utils import default_logger as logger
from elasticdl.python.elasticdl.feature_column import feature_column

NUMERIC = ["age", "hours"]
CATEGORICAL = ["workclass", "education"]


def get_feature_columns():
    columns = [tf.feature_column.numeric_column(key) for key in NUMERIC]
    for key in CATEGORICAL:
        columns.append(feature_column.embedding_column(
            tf.feature_column.categorical_column_with_hash_bucket(key, hash_bucket_size=16), dimension=4
        ))
    return columns


def custom_model():
    inputs = {key: tf.keras.Input(shape=(1,), name=key, dtype=tf.float32) for key in NUMERIC}
    inputs.update({key: tf.keras.Input(shape=(1,), name=key, dtype=tf.string) for key in CATEGORICAL})
    x = tf.keras.layers.DenseFeatures(get_feature_columns())(inputs)
    x = tf.keras.layers.Dense(8, activation="relu")(x)
    outputs = tf.keras.layers.Dense(1, activation="sigmoid")(x)
    logger.info("census model built")
    return tf.keras.Model(inputs=inputs, outputs=outputs)


def census_loss(labels, predictions):
    return tf.keras.losses.binary_crossentropy(tf.cast(tf.reshape(labels, [-1, 1]), tf.float32), predictions)


def census_optimizer(lr=0.05):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def census_metrics():
    return {"accuracy": tf.keras.metrics.BinaryAccuracy(), "auc": tf.keras.metrics.AUC()}


def census_feed(dataset, mode, _):
    spec = {key: tf.io.FixedLenFeature([1], tf.float32) for key in NUMERIC}
    spec.update({key: tf.io.FixedLenFeature([1], tf.string) for key in CATEGORICAL})
    if mode != Mode.PREDICTION:
        spec["label"] = tf.io.FixedLenFeature([1], tf.int64)

    def parse(record):
        r = tf.io.parse_single_example(record, spec)
        if mode == Mode.PREDICTION:
            return r
        label = r.pop("label")
        return r, label

    return dataset.map(parse)
