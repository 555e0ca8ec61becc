"""Shared by the dac_ctr modules, imported as ``from model_zoo.dac_ctr.feature_config import``:
the original's feature_config.py shape (statistics, boundaries and distinct counts given up front,
feature groups), for the two integer and two string features of the test data."""

STANDARDIZED_FEATURES = ["I1", "I2"]
FEATURES_AVGS = {"I1": 49.5, "I2": 50.0}
FEATURES_STDDEVS = {"I1": 28.9, "I2": 29.0}
BUCKET_FEATURES = ["I1", "I2"]
FEATURE_BOUNDARIES = {"I1": [10.0, 25.0, 50.0, 75.0], "I2": [-1.0, 0.0, 30.0, 30.0, 60.0]}  # a repeated one, as I2's
HASH_FEATURES = ["C1", "C2"]
FEATURE_DISTINCT_COUNT = {"C1": 49, "C2": 2_000_000}  # above MAX_HASHING_BUCKET_SIZE: capped
FEATURE_NAMES = STANDARDIZED_FEATURES + HASH_FEATURES
LABEL_KEY = "label"
FEATURE_GROUPS = [["I1", "C1"], ["I2"], ["C2"]]
