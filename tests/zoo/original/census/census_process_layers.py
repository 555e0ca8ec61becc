"""Preprocessing layers written as the original's keras_process_layer(s).py are (census wide &
deep): each ``call`` builds its op from raw TensorFlow; ``CategoryLookup`` makes a new lookup
table on every call (``lookup_ops.index_table_from_tensor``), a table no Keras layer tracks."""

import tensorflow as tf
from tensorflow.python.ops import lookup_ops, math_ops


class CategoryLookup(tf.keras.layers.Layer):
    def __init__(self, vocabulary):
        super().__init__()
        self.vocabulary = vocabulary

    def call(self, inputs):
        table = lookup_ops.index_table_from_tensor(vocabulary_list=self.vocabulary, num_oov_buckets=1)
        return tf.cast(table.lookup(inputs), tf.int64)


class CategoryHash(tf.keras.layers.Layer):
    def __init__(self, bucket_size):
        super().__init__()
        self.bucket_size = bucket_size

    def call(self, inputs):
        if inputs.dtype is not tf.string:
            inputs = tf.strings.as_string(inputs)
        return tf.cast(tf.strings.to_hash_bucket_fast(inputs, self.bucket_size), tf.int64)


class NumericBucket(tf.keras.layers.Layer):
    def __init__(self, boundaries):
        super().__init__()
        self.boundaries = boundaries

    def call(self, inputs):
        return tf.cast(math_ops._bucketize(tf.cast(inputs, tf.float32), boundaries=self.boundaries), tf.int64)


class AddIdOffset(tf.keras.layers.Layer):
    """Shifts each feature's ids by its offset, so one Embedding serves a group of features."""

    def __init__(self, offsets):
        super().__init__()
        self.offsets = offsets

    def call(self, inputs):
        return [ids + offset for ids, offset in zip(inputs, self.offsets)]
