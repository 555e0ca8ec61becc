"""Written as the original's cifar10_subclass.py is: a tf.keras.Model subclass with conv and
BatchNormalization layers as attributes, the training flag passed down, RMSprop."""

import tensorflow as tf
from model_zoo.cifar10.data_parser import dataset_fn, eval_metrics_fn, loss  # noqa: F401


class CustomModel(tf.keras.Model):
    def __init__(self, channel_last=True):
        super(CustomModel, self).__init__(name="cifar10_model")
        self._conv_1 = tf.keras.layers.Conv2D(4, kernel_size=(3, 3), padding="same", use_bias=False)
        self._bn_1 = tf.keras.layers.BatchNormalization(epsilon=1e-06, axis=-1, momentum=0.9)
        self._relu_1 = tf.keras.layers.Activation(tf.nn.relu)
        self._max_pool_1 = tf.keras.layers.MaxPooling2D()
        self._conv_2 = tf.keras.layers.Conv2D(8, kernel_size=(3, 3), padding="same", use_bias=False)
        self._bn_2 = tf.keras.layers.BatchNormalization(epsilon=1e-06, axis=-1, momentum=0.9)
        self._relu_2 = tf.keras.layers.Activation(tf.nn.relu)
        self._flatten = tf.keras.layers.Flatten()
        self._dense = tf.keras.layers.Dense(10, name="output")

    def call(self, inputs, training=False):
        x = self._max_pool_1(self._relu_1(self._bn_1(self._conv_1(inputs), training=training)))
        x = self._relu_2(self._bn_2(self._conv_2(x), training=training))
        return self._dense(self._flatten(x))


def optimizer(lr=0.01):
    return tf.optimizers.RMSprop(learning_rate=lr)
