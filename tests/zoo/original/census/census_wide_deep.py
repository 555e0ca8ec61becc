"""The original's census wide & deep idiom: a wide part of indicator and crossed columns (linear)
and a deep part of embedding columns, each through DenseFeatures, summed into one logit."""

import tensorflow as tf
from model_zoo.census.census_feature_columns import (  # noqa: F401
    CATEGORICAL,
    NUMERIC,
    dataset_fn,
    get_feature_input_layers,
    optimizer,
)

from elasticdl.python.elasticdl.feature_column import feature_column


def wide_columns():
    work = tf.feature_column.categorical_column_with_vocabulary_list("workclass", ["private", "gov", "self"])
    edu = tf.feature_column.categorical_column_with_vocabulary_list("education", ["hs", "ba", "phd"])
    age = tf.feature_column.bucketized_column(tf.feature_column.numeric_column("age"), [25, 35, 50])
    crossed = tf.feature_column.crossed_column([work, edu], hash_bucket_size=16)
    return [tf.feature_column.indicator_column(c) for c in (work, edu, crossed)] + [age]


def deep_columns():
    columns = [tf.feature_column.numeric_column(key) for key in NUMERIC]
    for key in CATEGORICAL:
        columns.append(feature_column.embedding_column(
            tf.feature_column.categorical_column_with_hash_bucket(key, hash_bucket_size=16), dimension=4))
    return columns


def custom_model():
    inputs = get_feature_input_layers()
    wide = tf.keras.layers.Dense(1)(tf.keras.layers.DenseFeatures(wide_columns())(inputs))
    deep = tf.keras.layers.DenseFeatures(deep_columns())(inputs)
    deep = tf.keras.layers.Dense(1)(tf.keras.layers.Dense(8, activation="relu")(deep))
    logits = tf.keras.layers.Add()([wide, deep])
    return tf.keras.Model(inputs=inputs, outputs={"logits": logits, "probs": tf.nn.sigmoid(logits)})


def loss(labels, predictions):
    labels = tf.cast(tf.reshape(labels, [-1, 1]), tf.float32)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=predictions["logits"]))


def eval_metrics_fn():
    return {"probs": {"auc": tf.keras.metrics.AUC()},
            "logits": {"accuracy": lambda labels, predictions: tf.equal(
                tf.cast(tf.reshape(predictions, [-1]) > 0, tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32))}}
