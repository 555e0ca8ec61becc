"""TensorBoard scalars from the master: loss, eval metrics, examples/s, live workers.

    tensorboard --logdir <--tensorboard_log_dir>
"""

from __future__ import annotations


class TensorBoardWriter:
    def __init__(self, log_dir: str):
        import tensorflow as tf

        try:
            import tensorboard  # noqa: F401  (tf.summary needs it; TensorFlow does not bring it)
        except ImportError as err:
            raise RuntimeError(
                "--tensorboard_log_dir needs the tensorboard package: pip install tensorboard"
            ) from err

        self._tf = tf
        self._writer = tf.summary.create_file_writer(log_dir)
        self.log_dir = log_dir

    def scalars(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        with self._writer.as_default():
            for name, value in values.items():
                if value is not None:
                    self._tf.summary.scalar(prefix + name, float(value), step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
