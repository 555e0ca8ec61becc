"""Export the trained model as a SavedModel that TensorFlow Serving can load."""

from __future__ import annotations

import logging
import os
import shutil

logger = logging.getLogger(__name__)


def export_saved_model(model, path: str) -> str:
    """Write ``model`` with a ``serving_default`` signature to ``path`` (replaced if present)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    # Keras 3's exporter traces model.call with the input spec it recorded when built.
    model.export(path, format="tf_saved_model", verbose=False)
    logger.info("SavedModel written to %s", path)
    return path
