"""Written as the original's dac_ctr/wide_deep_train.py is: the original's callbacks
(LearningRateScheduler by model version, MaxStepsStopping), ``dataset_fn(dataset, mode, _)``, and
every feature in one id group (``feature_groups=None``) through elasticdl_preprocessing's layers."""

import tensorflow as tf
from model_zoo.dac_ctr.ctr_models import wide_deep_model
from model_zoo.dac_ctr.feature_config import FEATURE_NAMES, HASH_FEATURES, LABEL_KEY, STANDARDIZED_FEATURES
from model_zoo.dac_ctr.feature_transform import transform_feature

from elasticdl.python.elasticdl.callbacks import LearningRateScheduler, MaxStepsStopping


def custom_model():
    input_layers = {name: tf.keras.layers.Input(name=name, shape=(1,),
                                                dtype=tf.int64 if name in STANDARDIZED_FEATURES else tf.string)
                    for name in FEATURE_NAMES}
    standardized_tensor, id_tensors, max_ids = transform_feature(input_layers, feature_groups=None)
    return wide_deep_model(input_layers, standardized_tensor, id_tensors, max_ids)


def loss(labels, predictions):
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, (-1, 1)), tf.float32), logits=predictions["logits"]))


def optimizer(lr=0.001):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def eval_metrics_fn():
    return {"probs": {"auc": tf.keras.metrics.AUC()}}


def callbacks():
    def _schedule(model_version):
        return 0.003 if model_version < 2 else 0.001

    return [LearningRateScheduler(_schedule), MaxStepsStopping(max_steps=200000)]


def dataset_fn(dataset, mode, _):
    def _parse_data(record):
        description = {n: tf.io.FixedLenFeature((1,), tf.int64) for n in STANDARDIZED_FEATURES}
        description.update({n: tf.io.FixedLenFeature((1,), tf.string) for n in HASH_FEATURES})
        description[LABEL_KEY] = tf.io.FixedLenFeature([], tf.int64)
        parsed = tf.io.parse_single_example(record, description)
        return parsed, parsed.pop(LABEL_KEY)

    return dataset.map(_parse_data)
