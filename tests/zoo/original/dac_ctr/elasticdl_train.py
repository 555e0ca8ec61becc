"""Written as the original's dac_ctr/elasticdl_train.py is: ``from model_zoo...`` imports, the
dataset function named ``feed``, elasticdl_preprocessing's layers on feature groups
(feature_transform.py), Adam, a dict of outputs with nested metrics, and a
PredictionOutputsProcessor on the original's base."""

import os

import numpy as np
import tensorflow as tf
from model_zoo.dac_ctr.ctr_models import MODELS
from model_zoo.dac_ctr.feature_config import (
    FEATURE_GROUPS,
    FEATURE_NAMES,
    HASH_FEATURES,
    LABEL_KEY,
    STANDARDIZED_FEATURES,
)
from model_zoo.dac_ctr.feature_transform import transform_feature

from elasticdl.python.worker.prediction_outputs_processor import BasePredictionOutputsProcessor


def custom_model(model="xdeepfm"):
    input_layers = get_input_layers(FEATURE_NAMES)
    standardized_tensor, id_tensors, max_ids = transform_feature(input_layers, feature_groups=FEATURE_GROUPS)
    return MODELS[model](input_layers, standardized_tensor, id_tensors, max_ids)


def get_input_layers(feature_names):
    return {name: tf.keras.layers.Input(name=name, shape=(1,), dtype=tf.int64 if name in STANDARDIZED_FEATURES
                                        else tf.string) for name in feature_names}


def loss(labels, predictions):
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, (-1, 1)), tf.float32), logits=predictions["logits"]))


def optimizer(lr=0.01):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def eval_metrics_fn():
    return {
        "logits": {"accuracy": lambda labels, predictions: tf.equal(
            tf.cast(tf.reshape(predictions, [-1]) > 0.0, tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32))},
        "probs": {"auc": tf.keras.metrics.AUC()},
    }


def feed(dataset, mode, _):
    def _parse_data(record):
        description = {n: tf.io.FixedLenFeature((1,), tf.int64) for n in STANDARDIZED_FEATURES}
        description.update({n: tf.io.FixedLenFeature((1,), tf.string) for n in HASH_FEATURES})
        description[LABEL_KEY] = tf.io.FixedLenFeature([], tf.int64)
        parsed = tf.io.parse_single_example(record, description)
        label = parsed.pop(LABEL_KEY)
        return parsed, label

    return dataset.map(_parse_data)


class PredictionOutputsProcessor(BasePredictionOutputsProcessor):
    """Appends each batch's probabilities to $DAC_OUTPUTS/worker-<id>.txt."""

    def process(self, predictions, worker_id):
        probs = predictions["probs"]
        assert isinstance(probs, tf.Tensor), type(probs)  # tensors, as the original passed
        with open(os.path.join(os.environ["DAC_OUTPUTS"], f"worker-{worker_id}.txt"), "a") as f:
            np.savetxt(f, probs.numpy().reshape(-1), fmt="%.6f")
