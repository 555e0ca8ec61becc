"""End to end: model.fit's sample weights and class weights in a real job (2 workers, 1 PS)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.test_e2e_evaluation import local_model, read_examples
from tests.test_e2e_local import digits, elasticdl, report_of  # noqa: F401

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def test_a_job_with_sample_weights_trains_and_weighs_its_metrics(digits, tmp_path):  # noqa: F811
    model_def = "weightzoo.digits_weighted.custom_model"
    report = report_of(elasticdl(
        ["train", "--model_zoo", ZOO, "--model_def", model_def,
         "--training_data", str(digits / "train"), "--validation_data", str(digits / "test"),
         "--num_workers", "2", "--num_ps", "1", "--minibatch_size", "32", "--num_epochs", "3",
         "--checkpoint_dir", str(tmp_path / "ckpt")],
        cwd=tmp_path,
    ))
    assert report["status"] == "succeeded" and report["records_trained"] == 3 * 1437
    final = report["evaluations"][-1]["metrics"]
    assert final["accuracy"] >= 0.85
    # The metrics weigh each test example as dataset_fn says (odd digits 3, even 1), as
    # model.evaluate(..., sample_weight=...) does: computed again here from the checkpoint.
    _, model = local_model(report["checkpoint"], ZOO, model_def)
    images, labels = read_examples(str(digits / "test" / "digits-000.tfrecord"))
    hits = np.argmax(model(images).numpy(), axis=1) == labels
    weights = 1.0 + 2.0 * (labels % 2)
    assert final["fn_accuracy"] == pytest.approx(float(np.sum(hits * weights) / np.sum(weights)), abs=1e-5)
    assert final["accuracy"] == pytest.approx(final["fn_accuracy"], abs=1e-5)


def _fit_nines(digits, class_weight):  # noqa: F811
    """model.fit of weightzoo/nines.py as a Keras user runs it; (accuracy, mean_p_nine) on the test data."""
    import glob

    import keras
    import tensorflow as tf

    from elasticdl.model.spec import load_model_spec

    spec = load_model_spec(ZOO, "weightzoo.nines.custom_model")
    parse = spec.dataset_fn.__globals__["parse"]
    train = tf.data.TFRecordDataset(sorted(glob.glob(str(digits / "train" / "*")))).map(parse)
    test = list(tf.data.TFRecordDataset(str(digits / "test" / "digits-000.tfrecord")).map(parse).batch(1000))[0]
    keras.utils.set_random_seed(0)
    model = spec.build_model({})
    model.compile(optimizer=spec.optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train.shuffle(2000, seed=0).batch(32), epochs=3, class_weight=class_weight, verbose=0)
    p = tf.nn.softmax(model(test[0])).numpy()
    return float(np.mean(p.argmax(1) == test[1].numpy()[:, 0])), float(p[:, 1].mean())


def test_a_class_weighted_job_matches_model_fit(digits, tmp_path):  # noqa: F811
    """1 in 10 digits is a 9, and the linear model sees only the top two pixel rows: weighing
    the 9s 9 times moves its predictions from 0.10 to about 0.45 (accuracy 0.90 to about 0.63);
    ElasticDL's --class_weight lands where model.fit(class_weight=...) does."""
    report = report_of(elasticdl(
        ["train", "--model_zoo", ZOO, "--model_def", "weightzoo.nines.custom_model",
         "--training_data", str(digits / "train"), "--validation_data", str(digits / "test"),
         "--num_workers", "1", "--num_ps", "1", "--minibatch_size", "32", "--num_epochs", "3",
         "--class_weight", "0:1.0,1:9.0"],
        cwd=tmp_path,
    ))
    final = report["evaluations"][-1]["metrics"]
    accuracy, mean_p = _fit_nines(digits, {0: 1.0, 1: 9.0})
    assert mean_p > 0.3 and accuracy < 0.8  # the weights count (unweighted: 0.10 and 0.90)
    assert final["mean_p_nine"] == pytest.approx(mean_p, abs=0.05)
    assert final["accuracy"] == pytest.approx(accuracy, abs=0.08)
