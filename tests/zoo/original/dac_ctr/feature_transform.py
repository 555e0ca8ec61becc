"""The dac_ctr feature transform (``from model_zoo.dac_ctr.feature_transform import``): raw TF
ops on the Keras inputs: standardize the integers, hash the strings into one id space."""

import tensorflow as tf
from model_zoo.dac_ctr.feature_config import BUCKETS, HASH_FEATURES, STANDARDIZED_FEATURES


def transform_feature(input_layers):
    standardized = tf.concat([tf.cast(input_layers[n], tf.float32) / 100.0 for n in STANDARDIZED_FEATURES], axis=1)
    ids = tf.concat([tf.strings.to_hash_bucket_fast(input_layers[n], BUCKETS) + i * BUCKETS
                     for i, n in enumerate(HASH_FEATURES)], axis=1)
    return standardized, ids, BUCKETS * len(HASH_FEATURES)
