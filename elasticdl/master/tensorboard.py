"""TensorBoard scalars from the master: loss, eval metrics, examples/s, live workers.

    tensorboard --logdir <--tensorboard_log_dir>
"""

from __future__ import annotations

import os
import shutil
import tempfile

from elasticdl import fs


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
        self.log_dir = log_dir
        # TensorFlow writes local files only: a remote log dir gets a local copy, uploaded on each flush.
        self._local = tempfile.mkdtemp(prefix="elasticdl-tensorboard-") if fs.is_remote(log_dir) else None
        self._writer = tf.summary.create_file_writer(self._local or log_dir)

    def scalars(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        with self._writer.as_default():
            for name, value in values.items():
                if value is not None:
                    self._tf.summary.scalar(prefix + name, float(value), step=step)
        self._writer.flush()
        self._upload()

    def close(self) -> None:
        self._writer.close()
        self._upload()
        if self._local:
            shutil.rmtree(self._local, ignore_errors=True)

    def _upload(self) -> None:
        if self._local:
            for name in os.listdir(self._local):
                fs.write_atomically(fs.join(self.log_dir, name), lambda f, n=name: f.write(fs.read_bytes(
                    os.path.join(self._local, n))))
