"""The original's census_sequential.py idiom: DenseFeatures first in a Sequential model."""

import tensorflow as tf
from model_zoo.census.census_feature_columns import (  # noqa: F401
    dataset_fn,
    eval_metrics_fn,
    get_feature_columns,
    loss,
    optimizer,
)


def custom_model():
    return tf.keras.Sequential([
        tf.keras.layers.DenseFeatures(get_feature_columns()),
        tf.keras.layers.Dense(8, activation="relu"),
        tf.keras.layers.Dense(1, activation="sigmoid"),
    ])
