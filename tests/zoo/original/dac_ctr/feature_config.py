"""Shared by the dac_ctr modules, imported as ``from model_zoo.dac_ctr.feature_config import``."""

STANDARDIZED_FEATURES = ["I1", "I2"]
HASH_FEATURES = ["C1", "C2"]
FEATURE_NAMES = STANDARDIZED_FEATURES + HASH_FEATURES
LABEL_KEY = "label"
BUCKETS = 32
