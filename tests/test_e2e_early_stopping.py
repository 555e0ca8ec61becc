"""End to end: evaluation and callbacks in step with training.

A model that stops improving after epoch 2 of 10 (tests/zoo/evalzoo/plateau.py): each epoch's
round evaluates the model as that epoch left it, ModelCheckpoint names the version it saves,
and EarlyStopping(patience=2) ends the job after epoch 4, before epoch 5's tasks start.
"""

from __future__ import annotations

import os

from tests.test_e2e_evaluation import TEST_ZOO
from tests.test_e2e_local import elasticdl, report_of

RECORDS, PER_TASK = 40, 10  # 4 tasks an epoch, one batch of 10 each: 4 model versions an epoch


def test_early_stopping_ends_the_job_after_epoch_4_of_10_on_each_epochs_own_model(tmp_path):
    data = tmp_path / "ones.csv"
    data.write_text("1.0\n" * RECORDS)
    os.environ["EVALZOO_OUT"] = str(tmp_path / "out")
    try:
        result = elasticdl(
            ["train", "--model_zoo", TEST_ZOO, "--model_def", "evalzoo.plateau.custom_model",
             "--training_data", str(data), "--validation_data", str(data),
             "--num_workers", "1", "--num_ps", "1", "--minibatch_size", str(PER_TASK),
             "--records_per_task", str(PER_TASK), "--num_epochs", "10", "--job_name", "plateau"],
            cwd=tmp_path,
        )
    finally:
        del os.environ["EVALZOO_OUT"]
    report = report_of(result)
    assert report["epochs"] == 4, report["evaluations"]
    assert report["records_done_per_epoch"] == [RECORDS] * 4
    assert report["stopped_early"].startswith("EarlyStopping: mse has not improved for 2 epochs")
    rounds = report["evaluations"]
    assert [r["reason"] for r in rounds] == ["epoch 1", "epoch 2", "epoch 3", "epoch 4"]
    # Each round evaluated the snapshot taken when its epoch ended: 4 updates an epoch.
    assert [r["model_version"] for r in rounds] == [4, 8, 12, 16]
    mse = [r["metrics"]["mse"] for r in rounds]
    assert mse[0] - mse[1] > 0.1 and abs(mse[3] - mse[1]) < 1e-6  # the learning rate is ~0 from epoch 3
    # ModelCheckpoint saved the versions whose metrics it saw improve, named by that version.
    assert sorted(os.listdir(tmp_path / "out")) == ["best-4", "best-8"]
    assert "ModelCheckpoint: saved version 8 (mse=" in result.stderr
    # TensorFlow's start-up banner is hidden in every role (--log_level debug shows it).
    worker_log = (tmp_path / "runs" / "plateau" / "logs" / "worker-0.log").read_text()
    assert "absl::InitializeLog" not in result.stderr + worker_log
