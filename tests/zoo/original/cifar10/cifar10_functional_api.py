"""Written as the original's cifar10_functional_api.py is: conv blocks with BatchNormalization
on tf.keras, the shared parsing from ``model_zoo.cifar10.data_parser``."""

import tensorflow as tf
from model_zoo.cifar10.data_parser import SIZE, dataset_fn, eval_metrics_fn, loss  # noqa: F401


def custom_model():
    inputs = tf.keras.layers.Input(shape=(SIZE, SIZE, 3), name="image")
    x = inputs
    for filters in (4, 8):
        x = tf.keras.layers.Conv2D(filters, (3, 3), padding="same", use_bias=False)(x)
        x = tf.keras.layers.BatchNormalization(epsilon=1e-06)(x)
        x = tf.keras.layers.Activation(tf.nn.relu)(x)
        x = tf.keras.layers.MaxPooling2D()(x)
        x = tf.keras.layers.Dropout(0.2)(x)
    x = tf.keras.layers.Flatten()(x)
    outputs = tf.keras.layers.Dense(10, name="output")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs, name="cifar10_model")


def optimizer(lr=0.1):
    return tf.optimizers.SGD(lr)
