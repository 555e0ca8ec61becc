"""TensorFlow process set-up: thread pools, GPU memory growth, device logging."""

from __future__ import annotations

import logging
import os
import sys
import tempfile

logger = logging.getLogger(__name__)


def quiet_tensorflow() -> None:
    """Hide TensorFlow's C++ log lines below warnings (set before TensorFlow is imported)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_tensorflow(verbose: bool = False):
    """Import TensorFlow (and look for GPUs) without its start-up banner; returns the module.

    TensorFlow's C++ side prints its banner (absl's "All log messages before
    absl::InitializeLog()", oneDNN, CUDA) straight to file descriptor 2 before any setting
    such as TF_CPP_MIN_LOG_LEVEL is read, so the import runs with fd 2 sent to a temporary
    file. Shown after all with ``verbose`` (``--log_level debug``), or when the import fails.
    For the processes ElasticDL starts itself (the CLI, workers): the Python API never
    touches its caller's file descriptors.
    """
    if verbose or "tensorflow" in sys.modules:
        import tensorflow as tf

        return tf
    quiet_tensorflow()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as banner:
        os.dup2(banner.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices("GPU")  # the CUDA probe prints here; later calls are cached
        except BaseException:
            os.dup2(saved, 2)
            banner.seek(0)
            sys.stderr.write(banner.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return tf


def default_threads(num_workers: int) -> int:
    """Cores shared among the workers of one machine, at least one each."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def configure_tensorflow(intra_op_threads: int) -> list[str]:
    """Limit thread pools and let workers share a GPU; returns the devices used.

    Must run before TensorFlow executes any op.
    """
    tf = load_tensorflow(verbose=logging.getLogger().isEnabledFor(logging.DEBUG))

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
