"""Export the final model as a SavedModel when training ends."""

from __future__ import annotations

from elasticdl.callbacks.callback import Callback


class SavedModelExporter(Callback):
    """Writes the trained model to ``export_dir`` at the end of training (besides --output).

    Example::

        def callbacks():
            return [SavedModelExporter("out/serving/1")]
    """

    def __init__(self, export_dir: str):
        super().__init__()
        self.export_dir = export_dir
        self.exported: str | None = None

    def on_train_end(self, logs=None):
        if self.job is not None:
            self.exported = self.job.export(self.export_dir)
