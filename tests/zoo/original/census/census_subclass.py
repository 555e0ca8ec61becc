"""The original's census_subclass.py idiom: a subclassed model holding a DenseFeatures layer."""

import tensorflow as tf
from model_zoo.census.census_feature_columns import (  # noqa: F401
    dataset_fn,
    eval_metrics_fn,
    get_feature_columns,
    loss,
    optimizer,
)


class CustomModel(tf.keras.Model):
    def __init__(self):
        super(CustomModel, self).__init__(name="census_model")
        self.dense_features = tf.keras.layers.DenseFeatures(get_feature_columns())
        self.hidden = tf.keras.layers.Dense(8, activation="relu")
        self.output_layer = tf.keras.layers.Dense(1, activation="sigmoid")

    def call(self, inputs, training=False):
        return self.output_layer(self.hidden(self.dense_features(inputs)))
