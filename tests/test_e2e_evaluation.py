"""End to end: evaluation rounds, callbacks, TensorBoard, `elasticdl evaluate` and `predict`."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from tests.test_e2e_local import digits, elasticdl, load_checkpoint_params, report_of  # noqa: F401

TEST_ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")
MODEL_DEF = "evalzoo.digits_callbacks.custom_model"


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):  # noqa: F811
    """A job that stops early through EarlyStopping; its checkpoint feeds evaluate and predict."""
    work = tmp_path_factory.mktemp("trained")
    os.environ["EVALZOO_OUT"] = str(work / "out")
    try:
        result = elasticdl(
            ["train", "--model_zoo", TEST_ZOO, "--model_def", MODEL_DEF,
             "--training_data", str(digits / "train"), "--validation_data", str(digits / "test"),
             "--num_workers", "2", "--num_ps", "1", "--minibatch_size", "32", "--num_epochs", "10",
             "--evaluation_steps", "15", "--checkpoint_dir", str(work / "ckpt"),
             "--tensorboard_log_dir", str(work / "tb"), "--output", str(work / "model")],
            cwd=work,
        )
    finally:
        del os.environ["EVALZOO_OUT"]
    return work, report_of(result)


def local_model(checkpoint: str, model_zoo: str, model_def: str):
    from elasticdl.model.spec import load_model_spec

    spec = load_model_spec(model_zoo, model_def)
    model = spec.build_model({})
    params = load_checkpoint_params(checkpoint)
    for var in model.trainable_variables:
        var.assign(params[var.path])
    return spec, model


def read_examples(path: str) -> tuple[np.ndarray, np.ndarray]:
    import tensorflow as tf

    from elasticdl.data.tfrecord import read_records

    images, labels = [], []
    for record in read_records(path, 0, 360):
        example = tf.train.Example.FromString(record)
        images.append(example.features.feature["image"].float_list.value)
        labels.append(example.features.feature["label"].int64_list.value[0])
    return np.array(images, np.float32), np.array(labels)


def test_early_stopping_and_callbacks(trained):
    work, report = trained
    assert "EarlyStopping" in report["stopped_early"]
    assert report["epochs"] < 10
    events = json.loads((work / "out" / "callback_events.json").read_text())
    assert events[0] == ["train_begin"] and events[-1] == ["train_end"]
    epoch_ends = [e for e in events if e[0] == "epoch_end"]
    # EarlyStopping (patience 1) fired at the second epoch, whose tasks then were the last.
    assert [e[1] for e in epoch_ends] == [0, 1] and report["epochs"] == 2
    assert {"loss", "accuracy", "fn_accuracy"} <= set(epoch_ends[0][2])
    assert os.path.isdir(work / "out" / "best") and os.path.isdir(work / "out" / "exported")
    reasons = [e["reason"] for e in report["evaluations"]]
    assert "epoch 1" in reasons and reasons[-1] in ("final", f"epoch {report['epochs']}")
    assert any(r.startswith("every 15") for r in reasons)
    assert os.path.isfile(report["report_file"])
    assert glob.glob(str(work / "tb" / "events.out.tfevents.*"))


def test_merged_metrics_count_every_record_once(trained, digits):  # noqa: F811
    """The final round's metrics equal evaluating the checkpoint on all 360 records locally."""
    work, report = trained
    final = report["evaluations"][-1]
    assert final["records"] == 360
    assert all(e["records"] == 360 for e in report["evaluations"])
    _, model = local_model(report["checkpoint"], TEST_ZOO, MODEL_DEF)
    images, labels = read_examples(str(digits / "test" / "digits-000.tfrecord"))
    accuracy = float(np.mean(np.argmax(model(images).numpy(), axis=1) == labels))
    assert final["model_version"] == report["model_version"]
    assert final["metrics"]["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert final["metrics"]["fn_accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_evaluate_command_matches_training_evaluation(trained, digits):  # noqa: F811
    work, report = trained
    result = report_of(elasticdl(
        ["evaluate", "--model_zoo", TEST_ZOO, "--model_def", MODEL_DEF,
         "--validation_data", str(digits / "test"), "--num_workers", "2",
         "--checkpoint_dir_for_init", str(work / "ckpt")],
        cwd=work,
    ))
    assert result["command"] == "evaluate"
    assert result["metrics"]["accuracy"] == pytest.approx(report["metrics"]["accuracy"], abs=1e-6)
    saved = json.loads(open(result["report_file"]).read())
    assert saved["metrics"] == result["metrics"]


def test_predict_writes_one_row_per_record_in_order(trained, digits):  # noqa: F811
    work, report = trained
    result = report_of(elasticdl(
        ["predict", "--model_zoo", TEST_ZOO, "--model_def", "evalzoo.digits_plain.custom_model",
         "--prediction_data", str(digits / "test"), "--num_workers", "2", "--records_per_task", "50",
         "--checkpoint_dir_for_init", str(work / "ckpt"), "--prediction_outputs", str(work / "pred")],
        cwd=work,
    ))
    table = np.loadtxt(result["predictions"], delimiter=",", skiprows=1)
    header = open(result["predictions"]).readline().strip()
    assert header == ",".join(f"logits_{i}" for i in range(10))  # the output's name (was output_0 ...)
    images, _ = read_examples(str(digits / "test" / "digits-000.tfrecord"))
    _, model = local_model(report["checkpoint"], TEST_ZOO, MODEL_DEF)
    assert table.shape == (360, 10)
    np.testing.assert_allclose(table, model.predict(images, verbose=0), atol=1e-4)


def test_predict_with_a_processor(trained, digits):  # noqa: F811
    work, _ = trained
    out = work / "processed"
    os.environ["EVALZOO_OUT"] = str(out)
    try:
        result = report_of(elasticdl(
            ["predict", "--model_zoo", TEST_ZOO, "--model_def", MODEL_DEF,
             "--prediction_data", str(digits / "test"), "--num_workers", "2",
             "--checkpoint_dir_for_init", str(work / "ckpt")],
            cwd=work,
        ))
    finally:
        del os.environ["EVALZOO_OUT"]
    assert result["predictions"] == ""  # the processor got them instead
    rows = [line.split() for f in glob.glob(str(out / "processed-*.txt")) for line in open(f)]
    assert sum(int(n) for _, n in rows) == 360
    assert {w for w, _ in rows} <= {"0", "1"}
