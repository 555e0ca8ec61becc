"""Blocks of the subclassed ResNet (``from model_zoo.resnet50_subclass.resnet50_model import``)."""

import tensorflow as tf


class IdentityBlock(tf.keras.Model):
    def __init__(self, kernel_size, filters):
        super(IdentityBlock, self).__init__(name="")
        filters1, filters2, filters3 = filters
        self.conv2a = tf.keras.layers.Conv2D(filters1, (1, 1), use_bias=False)
        self.bn2a = tf.keras.layers.BatchNormalization()
        self.conv2b = tf.keras.layers.Conv2D(filters2, kernel_size, padding="same", use_bias=False)
        self.bn2b = tf.keras.layers.BatchNormalization()
        self.conv2c = tf.keras.layers.Conv2D(filters3, (1, 1), use_bias=False)
        self.bn2c = tf.keras.layers.BatchNormalization()

    def call(self, input_tensor, training=False):
        x = tf.nn.relu(self.bn2a(self.conv2a(input_tensor), training=training))
        x = tf.nn.relu(self.bn2b(self.conv2b(x), training=training))
        x = self.bn2c(self.conv2c(x), training=training)
        return tf.nn.relu(x + input_tensor)


class ConvBlock(tf.keras.Model):
    def __init__(self, kernel_size, filters, strides=(2, 2)):
        super(ConvBlock, self).__init__(name="")
        filters1, filters2, filters3 = filters
        self.conv2a = tf.keras.layers.Conv2D(filters1, (1, 1), strides=strides, use_bias=False)
        self.bn2a = tf.keras.layers.BatchNormalization()
        self.conv2b = tf.keras.layers.Conv2D(filters2, kernel_size, padding="same", use_bias=False)
        self.bn2b = tf.keras.layers.BatchNormalization()
        self.conv2c = tf.keras.layers.Conv2D(filters3, (1, 1), use_bias=False)
        self.bn2c = tf.keras.layers.BatchNormalization()
        self.conv_shortcut = tf.keras.layers.Conv2D(filters3, (1, 1), strides=strides, use_bias=False)
        self.bn_shortcut = tf.keras.layers.BatchNormalization()

    def call(self, input_tensor, training=False):
        x = tf.nn.relu(self.bn2a(self.conv2a(input_tensor), training=training))
        x = tf.nn.relu(self.bn2b(self.conv2b(x), training=training))
        x = self.bn2c(self.conv2c(x), training=training)
        shortcut = self.bn_shortcut(self.conv_shortcut(input_tensor), training=training)
        return tf.nn.relu(x + shortcut)
