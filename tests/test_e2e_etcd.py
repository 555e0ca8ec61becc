"""End to end with a real etcd: a killed master resumes, a second master is refused, outages pass."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.test_e2e_elastic import _master_log, _wait_for
from tests.test_e2e_local import digits, report_of, train_args  # noqa: F401


def _command(digits, tmp_path, etcd, job: str, **flags) -> list[str]:  # noqa: F811
    return [sys.executable, "-m", "elasticdl", *train_args(
        digits, "digits.digits_functional.custom_model", job_name=job, etcd_endpoints=etcd,
        num_workers=2, num_ps=1, **flags,
    )]


def _run(command, tmp_path) -> dict:
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return report_of(result)


def test_killed_master_resumes_from_etcd(digits, tmp_path, etcd_process):  # noqa: F811
    command = _command(digits, tmp_path, etcd_process.endpoint, "resume", num_epochs=4,
                       checkpoint_dir=tmp_path / "ckpt", checkpoint_steps=10)
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: "epoch 3 of 4 starts" in _master_log(tmp_path, "resume"), 180, "epoch 3")
        first.kill()  # the master dies hard; its PS and workers die with it
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    report = _run(command, tmp_path)
    assert report["resumed"] and report["state_store"] == "etcd"
    # Every record of every epoch trained; the epochs the first master finished were not redone.
    assert report["records_done_per_epoch"] == [report["records_per_epoch"]] * 4
    # The two epochs the first master finished were not trained again. (The ledger is saved
    # every fraction of a second, so the last few tasks before the kill may be redone.)
    assert report["records_trained"] <= 2.5 * report["records_per_epoch"]
    assert report["metrics"]["accuracy"] >= 0.90
    assert "resumed the task ledger" in _master_log(tmp_path, "resume")


def test_second_master_for_the_same_job_is_refused(digits, tmp_path, etcd_process):  # noqa: F811
    command = _command(digits, tmp_path, etcd_process.endpoint, "twice", num_epochs=200)
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: "job state in etcd" in _master_log(tmp_path, "twice"), 120, "the first master")
        second = subprocess.run(command, cwd=tmp_path / "..", capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert "another master" in second.stderr and "/elasticdl/twice/master" in second.stderr
        assert first.poll() is None  # the first one is unharmed
    finally:
        first.kill()
        first.wait(10)


def test_etcd_outage_mid_job(digits, tmp_path, etcd_process):  # noqa: F811
    command = _command(digits, tmp_path, etcd_process.endpoint, "outage", num_epochs=4)
    job = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: "epoch 2 of 4 starts" in _master_log(tmp_path, "outage"), 180, "epoch 2")
        etcd_process.stop()
        time.sleep(3)
        etcd_process.start()
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    report = report_of(subprocess.CompletedProcess(job.args, job.returncode, out, err))
    assert report["etcd_outages"] and report["etcd_outages"][0]["seconds"] > 0
    assert report["records_done_per_epoch"] == [report["records_per_epoch"]] * 4
    assert report["metrics"]["accuracy"] >= 0.90
