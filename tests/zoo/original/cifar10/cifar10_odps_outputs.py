"""Written as the original's cifar10_functional_api.py is in its last form: the constants
``MaxComputeConfig`` and ``Mode``, ``default_logger``, ``ODPSWriter`` and ``is_odps_configured``
from ``elasticdl.python.data.odps_io``, ``LearningRateScheduler`` in ``callbacks()``, and a
PredictionOutputsProcessor that writes to an ODPS table when ODPS is configured (refused here,
naming --prediction_outputs) and logs the predictions otherwise."""

import os

import tensorflow as tf
from model_zoo.cifar10.data_parser import SIZE, dataset_fn, eval_metrics_fn, loss  # noqa: F401

from elasticdl.python.common.constants import MaxComputeConfig, Mode
from elasticdl.python.common.log_utils import default_logger as logger
from elasticdl.python.data.odps_io import ODPSWriter, is_odps_configured
from elasticdl.python.elasticdl.callbacks import LearningRateScheduler
from elasticdl.python.worker.prediction_outputs_processor import BasePredictionOutputsProcessor


def custom_model():
    inputs = tf.keras.layers.Input(shape=(SIZE, SIZE, 3), name="image")
    x = tf.keras.layers.Conv2D(4, kernel_size=(3, 3), padding="same")(inputs)
    x = tf.keras.layers.BatchNormalization(epsilon=1e-06, axis=-1, momentum=0.9)(x)
    x = tf.keras.layers.Activation(tf.nn.relu)(x)
    x = tf.keras.layers.Dropout(0.2)(tf.keras.layers.MaxPooling2D(pool_size=(2, 2))(x))
    outputs = tf.keras.layers.Dense(10, name="output")(tf.keras.layers.Flatten()(x))
    return tf.keras.Model(inputs=inputs, outputs=outputs, name="cifar10_model")


def optimizer(lr=0.1):
    return tf.optimizers.SGD(lr)


def callbacks():
    def _schedule(model_version):
        return 0.1 if model_version < 5000 else 0.01

    return [LearningRateScheduler(_schedule)]


def training_mode_shuffles(mode):  # Mode is the original's path to the modes
    return mode == Mode.TRAINING


class PredictionOutputsProcessor(BasePredictionOutputsProcessor):
    def __init__(self):
        if is_odps_configured():
            self.odps_writer = ODPSWriter(
                os.environ[MaxComputeConfig.PROJECT_NAME], os.environ[MaxComputeConfig.ACCESS_ID],
                os.environ[MaxComputeConfig.ACCESS_KEY], os.environ[MaxComputeConfig.ENDPOINT],
                "cifar10_prediction_outputs", columns=[f"f{i}" for i in range(10)],
                column_types=["double"] * 10,
            )
        else:
            self.odps_writer = None

    def process(self, predictions, worker_id):
        if self.odps_writer:
            self.odps_writer.from_iterator(iter(predictions.numpy().tolist()), worker_id)
        else:
            logger.info(predictions.numpy())
