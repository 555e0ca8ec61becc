"""TensorFlow process set-up: thread pools, GPU memory growth, device logging."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def quiet_tensorflow() -> None:
    """Hide TensorFlow's C++ start-up chatter unless the user asked for it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def default_threads(num_workers: int) -> int:
    """Cores shared among the workers of one machine, at least one each."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def configure_tensorflow(intra_op_threads: int) -> list[str]:
    """Limit thread pools and let workers share a GPU; returns the devices used.

    Must run before TensorFlow executes any op.
    """
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, intra_op_threads)))
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        # Without growth, the first process on a card takes all of its memory.
        tf.config.experimental.set_memory_growth(gpu, True)
    devices = [d.name for d in gpus] or ["/physical_device:CPU:0"]
    logger.info(
        "TensorFlow %s on %s (%d intra-op threads)",
        tf.__version__, ", ".join(devices), intra_op_threads,
    )
    return devices
