"""Sample weights as model.fit takes them: a dataset_fn yielding (features, labels, sample_weight)
gives the loss, the gradients and the metrics model.fit would compute."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl.config import JobConfig
from elasticdl.data.tfrecord import write_records
from elasticdl.master.preflight import check_job
from elasticdl.model.metrics import MetricsAccumulator
from elasticdl.model.spec import ModelSpecError, load_model_spec
from elasticdl.model.trainer import Trainer

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def _batch(n: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, (n, 1))
    weights = (1.0 + 2.0 * (labels[:, 0] % 2)).astype(np.float32)
    return tf.constant(rng.random((n, 64), np.float32)), tf.constant(labels), tf.constant(weights)


def _keras_loss_and_gradients(model, features, labels, weights):
    """What model.fit computes for one batch: the compiled loss with the sample weights."""
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with tf.GradientTape() as tape:
        predictions = model(features, training=True)
        loss = model.compute_loss(x=features, y=labels, y_pred=predictions, sample_weight=weights)
    return float(loss), tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("module", ["digits_weighted", "digits_loss_object"])
def test_the_loss_and_gradients_of_a_weighted_batch_are_keras_s(module):
    spec = load_model_spec(ZOO, f"weightzoo.{module}.custom_model")
    trainer = Trainer(spec, {})
    features, labels, weights = _batch()
    trainer.ensure_built(features)
    loss, grads = trainer.compute_gradients(features, labels, weights)
    expected_loss, expected = _keras_loss_and_gradients(trainer.model, features, labels, weights)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    unweighted, _ = trainer.compute_gradients(features, labels)
    assert abs(loss - unweighted) > 1e-3  # the weights count: not the plain mean
    for var, value in zip(trainer.model.trainable_variables, expected):
        np.testing.assert_allclose(grads[var.path], value.numpy(), rtol=1e-5, atol=1e-7)


def test_a_weighted_batch_does_not_trace_the_step_again():
    trainer = Trainer(load_model_spec(ZOO, "weightzoo.digits_weighted.custom_model"), {})
    features, labels, weights = _batch(16)
    trainer.ensure_built(features)
    trainer.compute_gradients(features, labels, weights)
    trainer.compute_gradients(*_batch(5, seed=1))  # an epoch's last, smaller batch
    assert trainer._train_step.experimental_get_tracing_count() == 1


def test_a_loss_that_returns_a_scalar_cannot_weigh_its_examples_and_says_how():
    from elasticdl.model.sample_weight import weighted_loss

    spec = load_model_spec(ZOO, "weightzoo.digits_scalar_loss.custom_model")
    features, labels, weights = _batch()
    predictions = spec.build_model({})(features)
    with pytest.raises(ModelSpecError) as info:
        weighted_loss(spec.loss, labels, predictions, weights, spec.module_path)
    message = str(info.value)
    assert "digits_scalar_loss.py: dataset_fn yields (features, labels, sample_weight), but loss(labels, " \
           "predictions) returns a scalar" in message
    assert "Return one loss value per example" in message and "sample_weight argument" in message


def test_metrics_weigh_the_examples_as_keras_metrics_do():
    def correct(labels, predictions):
        return tf.cast(tf.equal(tf.reshape(labels, [-1]), tf.argmax(predictions, axis=1)), tf.float32)

    features, labels, weights = _batch(32)
    predictions = tf.constant(np.random.default_rng(3).random((32, 10), np.float32))
    accumulator = MetricsAccumulator({"accuracy": keras.metrics.SparseCategoricalAccuracy(), "fn": correct})
    accumulator.update(labels, predictions, weights)
    result = accumulator.result()
    expected = keras.metrics.SparseCategoricalAccuracy()
    expected.update_state(labels, predictions, sample_weight=weights)
    hits = correct(labels, predictions).numpy()
    assert result["accuracy"] == pytest.approx(float(expected.result()), abs=1e-6)
    assert result["fn"] == pytest.approx(float(np.sum(hits * weights.numpy()) / np.sum(weights.numpy())), abs=1e-6)
    assert result["fn"] != pytest.approx(float(np.mean(hits)), abs=1e-6)  # the weights count


def _digits_like(path, n: int = 40) -> str:
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        feature = {"image": tf.train.Feature(float_list=tf.train.FloatList(value=rng.random(64))),
                   "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 10]))}
        records.append(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    write_records(path, records)
    return str(path)


def test_the_submit_takes_a_dataset_fn_that_yields_weights(tmp_path, caplog):
    data = _digits_like(tmp_path / "digits.tfrecord")
    config = JobConfig.from_flags(model_zoo=ZOO, model_def="weightzoo.digits_weighted.custom_model",
                                  training_data=data, validation_data=data, minibatch_size=8)
    checked = check_job(config)
    assert checked.spec.module_path.endswith("digits_weighted.py")
    # Per-example values are what a weighted loss returns: no advice to reduce them.
    assert not [r for r in caplog.records if "not a scalar" in r.getMessage()]


def test_the_submit_refuses_a_scalar_loss_with_weights(tmp_path):
    data = _digits_like(tmp_path / "digits.tfrecord")
    config = JobConfig.from_flags(model_zoo=ZOO, model_def="weightzoo.digits_scalar_loss.custom_model",
                                  training_data=data, minibatch_size=8)
    with pytest.raises(ModelSpecError, match="returns a scalar, so its examples cannot be weighted"):
        check_job(config)


def test_a_four_element_dataset_fn_is_named_with_what_it_may_yield(tmp_path):
    from elasticdl.model.sample_weight import unpack

    spec = load_model_spec(ZOO, "weightzoo.digits_weighted.custom_model")
    with pytest.raises(ModelSpecError, match=r"digits_weighted.py: in training mode dataset_fn must yield \(features, labels\) "
                                             r"pairs or \(features, labels, sample_weight\) triples\. "
                                             r"Received elements of type a tuple of 4"):
        unpack((1, 2, 3, 4), spec, "training")
