"""TensorFlow process set-up: thread pools, GPU memory growth, device logging."""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import sys
import tempfile

logger = logging.getLogger(__name__)


def quiet_tensorflow() -> None:
    """Hide TensorFlow's C++ log lines below warnings (set before TensorFlow is imported)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# Packages Keras imports at start-up only if they are installed (its scikit-learn wrappers,
# its plotting helpers) and that no ElasticDL role uses: with them installed `import
# tensorflow` took 5.3 s instead of 2.8 s on the 2-core benchmark machine, half of a
# worker's time to its first gradient (docs/benchmarks.md, "where the time goes").
KERAS_OPTIONAL_EXTRAS = ("sklearn", "matplotlib", "scipy", "pandas")


class _Unavailable(importlib.abc.MetaPathFinder):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.packages:
            raise ImportError(f"{name} is not imported while TensorFlow starts (elasticdl.model.tf_runtime)")
        return None


@contextlib.contextmanager
def without_optional_extras(packages: tuple[str, ...] = KERAS_OPTIONAL_EXTRAS):
    """Within the block, importing ``packages`` fails as if they were not installed (unless they
    were imported already). Keras catches that and leaves the features that need them out; a
    model zoo that imports them later (after the block) gets them as usual."""
    finder = _Unavailable(tuple(p for p in packages if p not in sys.modules))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def load_tensorflow(verbose: bool = False):
    """Import TensorFlow (and look for GPUs) without its start-up banner; returns the module.

    TensorFlow's C++ side prints its banner (absl's "All log messages before
    absl::InitializeLog()", oneDNN, CUDA) straight to file descriptor 2 before any setting
    such as TF_CPP_MIN_LOG_LEVEL is read, so the import runs with fd 2 sent to a temporary
    file. Shown after all with ``verbose`` (``--log_level debug``), or when the import fails.
    For the processes ElasticDL starts itself (the CLI, workers): the Python API never
    touches its caller's file descriptors. Keras's optional extras are left out of the import
    (``without_optional_extras``).
    """
    if verbose or "tensorflow" in sys.modules:
        with without_optional_extras():  # Keras's optional extras: see KERAS_OPTIONAL_EXTRAS
            import tensorflow as tf

        return tf
    quiet_tensorflow()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as banner:
        os.dup2(banner.fileno(), 2)
        try:
            with without_optional_extras():  # Keras's optional extras: see KERAS_OPTIONAL_EXTRAS
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
