"""End to end (real PS and worker processes): a job whose very end fails still writes
report.json, which says what failed, and raises the failure with its exit code."""

from __future__ import annotations

import errno
import json

import pytest

from tests.test_e2e_local import MODEL_ZOO, digits  # noqa: F401


def test_an_export_that_fails_after_training_leaves_the_checkpoint_and_the_report(digits, tmp_path, monkeypatch):  # noqa: F811
    import elasticdl
    from elasticdl.errors import JobFailedError, exit_status
    from elasticdl.model import checkpoint, export

    def full_disk(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    # The master runs in this process: its export meets a disk that filled during training.
    monkeypatch.setattr(export, "export_saved_model", full_disk)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JobFailedError, match="exporting the SavedModel to --output .* No space left") as info:
        elasticdl.train(
            model_zoo=MODEL_ZOO, model_def="digits.digits_functional.custom_model",
            training_data=str(digits / "train"), minibatch_size=64, num_epochs=1, num_workers=1, num_ps=1,
            checkpoint_dir=str(tmp_path / "ckpt"), output=str(tmp_path / "model"), job_name="late-export",
        )
    assert exit_status(info.value)[0] == 1
    report = json.loads((tmp_path / "runs" / "late-export" / "report.json").read_text())
    assert report["status"] == "failed" and report["failed_step"] == "export" and report["exit_code"] == 1
    assert "No space left on device" in report["error"]
    assert report["epochs"] == 1 and report["records_trained"] > 0 and report["model_version"] > 0
    # What the job finished before the failure is there, and named in the report.
    assert report["checkpoint"] and checkpoint.complete_versions(str(tmp_path / "ckpt"))
    assert report["checkpoint_failures"] == 0 and not (tmp_path / "model").exists()
