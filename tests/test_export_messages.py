"""The export says what it does before it starts (tracing and writing a SavedModel take seconds:
the terminal must not sit silent), and the SavedModel has both Keras endpoints."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from elasticdl.model.export import export_saved_model


def test_the_export_is_announced_before_it_runs_and_has_both_endpoints(tmp_path, caplog):
    inputs = keras.Input((3,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(inputs))
    path = str(tmp_path / "model")
    with caplog.at_level(logging.INFO, logger="elasticdl.model.export"):
        export_saved_model(model, path)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"exporting the SavedModel to {path}", f"SavedModel written to {path}"]
    loaded = tf.saved_model.load(path)
    batch = np.ones((2, 3), np.float32)
    assert loaded.serve(batch).shape == (2, 2)
    assert loaded.signatures["serving_default"](x=tf.constant(batch))["output_0"].shape == (2, 2)
