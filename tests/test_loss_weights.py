"""compile(loss_weights=...) for a model with several outputs, written in loss() as
docs/model_zoo.md says: the same loss and gradients as the compiled Keras model."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl.model.spec import load_model_spec
from elasticdl.model.trainer import Trainer

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


@pytest.mark.parametrize("weighted", [False, True])
def test_the_documented_loss_weights_equal_keras_s(weighted):
    spec = load_model_spec(ZOO, "weightzoo.two_outputs.custom_model")
    trainer = Trainer(spec, {})
    rng = np.random.default_rng(0)
    features = tf.constant(rng.random((16, 8), np.float32))
    labels = {name: tf.constant(rng.integers(0, 2, (16, 1)).astype(np.float32)) for name in ("ctr", "cvr")}
    sample_weight = tf.constant(rng.random(16).astype(np.float32) * 3) if weighted else None
    trainer.ensure_built(features)
    loss, grads = trainer.compute_gradients(features, labels, sample_weight)

    model = trainer.model
    model.compile(optimizer="sgd", loss={"ctr": keras.losses.BinaryCrossentropy(),
                                         "cvr": keras.losses.BinaryCrossentropy()},
                  loss_weights={"ctr": 1.0, "cvr": 0.5})
    with tf.GradientTape() as tape:
        predictions = model(features, training=True)
        expected = model.compute_loss(x=features, y=labels, y_pred=predictions, sample_weight=sample_weight)
    expected_grads = tape.gradient(expected, model.trainable_variables)
    assert loss == pytest.approx(float(expected), rel=1e-5)
    for var, value in zip(model.trainable_variables, expected_grads):
        np.testing.assert_allclose(grads[var.path], value.numpy(), rtol=1e-4, atol=1e-6)
