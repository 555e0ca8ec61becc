"""End to end: a damaged newest checkpoint shard, then a PS SIGKILL: the job falls back to the
cut before it and finishes with every record applied exactly once (it used to fail). A damaged
cut named explicitly fails at submit, naming the file."""

from __future__ import annotations

import os
import signal
import subprocess

import numpy as np

from elasticdl.model import checkpoint
from tests.test_e2e_elastic import _master_log, _ps_pids, _start, _wait_for
from tests.test_e2e_local import MODEL_ZOO, digits, elasticdl, report_of  # noqa: F401


def test_a_damaged_newest_shard_then_a_ps_kill_falls_back_to_the_cut_before(digits, tmp_path):  # noqa: F811
    job, ckpt = "damaged-cut", tmp_path / "ckpt"
    proc = _start(digits, tmp_path, job, num_workers=2, num_ps=2, num_epochs=3,
                  checkpoint_dir=ckpt, checkpoint_steps=20)
    try:
        _wait_for(lambda: len(checkpoint.complete_versions(str(ckpt))) >= 2, 120, "two complete cuts")
        survivor, victim = _ps_pids(proc.pid, tmp_path)[1], _ps_pids(proc.pid, tmp_path)[0]
        # PS 1 stopped: no new cut can complete while the newest one is damaged and PS 0 killed.
        os.kill(survivor, signal.SIGSTOP)
        try:
            newest = checkpoint.complete_versions(str(ckpt))[-1]
            [shard] = (ckpt / f"version-{newest}").glob("ps-1-of-2.term-*.npz")
            with open(shard, "r+b") as f:
                f.truncate(shard.stat().st_size // 2)
            os.kill(victim, signal.SIGKILL)
        finally:
            os.kill(survivor, signal.SIGCONT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = report_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert f"passed over checkpoint {ckpt}/version-{newest}" in _master_log(tmp_path, job)
    (rollback,) = report["ps_rollbacks"]
    assert rollback["to_version"] < newest and rollback["records_possibly_missing"] == 0
    assert report["exactly_once"]["holds"] is True
    assert report["exactly_once"]["records_done"] == 3 * 1437


def test_evaluate_of_a_damaged_named_cut_fails_at_submit_naming_the_file(digits, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    state = checkpoint.ShardState(8, 8, {"v": np.zeros(2, np.float32)}, {}, term=1)
    path = checkpoint.save_shard(str(ckpt), 0, 1, state)
    with open(path, "r+b") as f:
        f.truncate(100)
    result = elasticdl(["evaluate", "--model_zoo", MODEL_ZOO, "--model_def", "digits.digits_functional.custom_model",
                        "--validation_data", str(digits / "test"), "--checkpoint_dir_for_init",
                        str(ckpt / "version-8")], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"checkpoint shard {path} is damaged" in result.stderr
    assert f"Pass the checkpoint directory {ckpt} to use the newest checkpoint that verifies" in result.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/logs/ps-*.log"))  # no PS started
