"""The dac_ctr feature transform (``from model_zoo.dac_ctr.feature_transform import``), built as the
original's is: elasticdl_preprocessing's Normalizer on the integers, Discretization and Hashing
into ids, ConcatenateWithOffset putting each group's ids in one id space."""

import tensorflow as tf
from model_zoo.dac_ctr.feature_config import (
    BUCKET_FEATURES,
    FEATURE_BOUNDARIES,
    FEATURE_DISTINCT_COUNT,
    FEATURES_AVGS,
    FEATURES_STDDEVS,
    HASH_FEATURES,
    STANDARDIZED_FEATURES,
)

from elasticdl.python.common.log_utils import default_logger as logger
from elasticdl_preprocessing.layers import ConcatenateWithOffset, Discretization, Hashing, Normalizer

MAX_HASHING_BUCKET_SIZE = 64  # the original caps at a million; a small table keeps the test cheap


def transform_feature(inputs, feature_groups):
    """Returns the standardized floats, a dict of id tensors (one per group: ``group_0``, ...)
    and a dict of each group's id count."""
    standardized = [Normalizer(subtractor=FEATURES_AVGS[name], divisor=FEATURES_STDDEVS[name])(inputs[name])
                    for name in STANDARDIZED_FEATURES]
    numerical_tensor = tf.concat(standardized, -1) if standardized else None
    if not feature_groups:
        feature_groups = [BUCKET_FEATURES + HASH_FEATURES]
    id_tensors, max_ids = {}, {}
    for i, features in enumerate(feature_groups):
        id_tensors[f"group_{i}"], max_ids[f"group_{i}"] = transform_group(inputs, features)
    return numerical_tensor, id_tensors, max_ids


def transform_group(inputs, features):
    """One group's ids, each feature's shifted past the previous ones', and the group's id count."""
    items, offsets = [], [0]
    for name in features:
        if name in BUCKET_FEATURES:
            layer = Discretization(bins=FEATURE_BOUNDARIES[name])
            items.append(layer(inputs[name]))
            offsets.append(offsets[-1] + len(layer.bins) + 1)
            logger.info(f"{name}:{layer.bins}")
        elif name in HASH_FEATURES:
            layer = Hashing(num_bins=min(FEATURE_DISTINCT_COUNT[name], MAX_HASHING_BUCKET_SIZE))
            items.append(layer(inputs[name]))
            offsets.append(offsets[-1] + layer.num_bins)
            logger.info(f"{name}:{layer.num_bins}")
        else:
            logger.warning(f"The preprocessing is not configured for the feature {name}")
    return ConcatenateWithOffset(offsets[0:-1])(items), offsets[-1]
