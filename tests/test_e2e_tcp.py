"""End to end with --tensor_transport tcp: a model whose PS parts are above the 4 MB raw-TCP
threshold trains over the raw sockets, and a PS SIGKILLed mid-job is restored from a
checkpoint with every record's gradients applied exactly once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_e2e_elastic import _master_log, _report_after_ps_kill

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = 1280


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The benchmark's 5M-parameter MLP's records (benchmarks/data.py, seeded): 20 MB of
    parameters, 10 MB on each of two PS."""
    sys.path.insert(0, REPO)
    from benchmarks.data import prepare

    root = tmp_path_factory.mktemp("dense")
    return prepare(str(root), {"dense": {"kind": "dense", "records": RECORDS, "dim": 768}})["dense"]["dir"]


def test_a_dense_model_over_tcp_survives_a_ps_kill_exactly_once(dense, tmp_path):
    job = "tcp-chaos"
    command = [
        sys.executable, "-m", "elasticdl", "train", "--model_zoo", os.path.join(REPO, "benchmarks", "model_zoo"),
        "--model_def", "dense.dense_mlp.custom_model", "--training_data", dense, "--job_name", job,
        "--num_workers", "1", "--num_ps", "2", "--minibatch_size", "64", "--num_epochs", "3",
        "--tensor_transport", "tcp", "--checkpoint_dir", str(tmp_path / "ckpt"), "--checkpoint_steps", "10",
    ]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = _report_after_ps_kill(proc, tmp_path, lambda: os.path.isdir(tmp_path / "ckpt" / "version-20"),
                                   "a checkpoint", ps=1, wait=180)
    assert report["ps_relaunches"] == 1
    assert "every PS goes back to version" in _master_log(tmp_path, job)
    # Nothing lost, nothing applied twice, on either PS.
    assert report["exactly_once"] == {"records_applied": [3 * RECORDS] * 2, "records_done": 3 * RECORDS, "holds": True}
    # The tensors went over the raw sockets: each PS (the relaunched one too) served the worker there.
    logs = tmp_path / "runs" / job / "logs"
    for ps, starts in ((0, 1), (1, 2)):
        text = (logs / f"ps-{ps}.log").read_text()
        assert text.count("tensor bytes also on raw TCP port") == starts, text[-2000:]
        last_start = text.rindex("tensor bytes also on raw TCP port")
        assert "raw-TCP connection from" in text[last_start:], text[-2000:]
