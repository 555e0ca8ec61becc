"""The original's census_functional_api.py idiom: DenseFeatures in a functional model."""

import tensorflow as tf
from model_zoo.census.census_feature_columns import (  # noqa: F401
    dataset_fn,
    eval_metrics_fn,
    get_feature_columns,
    get_feature_input_layers,
    loss,
    optimizer,
)


def custom_model():
    input_layers = get_feature_input_layers()
    x = tf.keras.layers.DenseFeatures(get_feature_columns())(input_layers)
    x = tf.keras.layers.Dense(8, activation="relu")(x)
    y = tf.keras.layers.Dense(1, activation="sigmoid")(x)
    return tf.keras.Model(inputs=input_layers, outputs=y)
