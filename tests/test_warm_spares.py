"""Warm spares (elasticdl/launch/warm.py): real role processes that import their modules
before the local backend hands them a command line. Correctness only: what a spare-started
role does, not how fast it starts (docs/benchmarks.md measures that)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from elasticdl.config import JobConfig
from elasticdl.launch.local import LocalBackend
from elasticdl.rpc.ps_client import PSClient
from tests.test_e2e_elastic import _master_log, _start, _wait_for, _worker_pids
from tests.test_e2e_local import digits, report_of  # noqa: F401


def test_a_parameter_server_imports_no_tensorflow():
    """Its spare only imports the PS's modules: 2 cores stay free for the workers' TensorFlow."""
    code = ("import importlib, sys; importlib.import_module('elasticdl.ps.main'); "
            "import elasticdl.launch.warm; print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_ps_spare_serves_once_given_its_command_line_and_unused_spares_leave_quietly(tmp_path):
    config = JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="d", job_name="warm")
    (tmp_path / "job_config.json").write_text(config.to_json())
    (tmp_path / "optimizer.json").write_text(json.dumps({"name": "SGD", "config": {"learning_rate": 0.1}}))
    args = ["--job_config", str(tmp_path / "job_config.json"), "--optimizer_spec", str(tmp_path / "optimizer.json"),
            "--ps_id", "0"]
    backend = LocalBackend(str(tmp_path / "logs"), spares=1)
    try:
        backend.prewarm("ps", 1)
        [spare] = backend._spares["ps"]
        backend.start("ps", 0, args)
        assert backend.pid("ps", 0) == spare.pid  # the spare, not a new process
        [address] = backend.ps_addresses(1, 60)
        ps = PSClient([address], token=backend.token())
        assert [s.version for s in ps.stats()] == [0]  # it serves, with the job's token
        ps.close()
        [replacement] = backend._spares["ps"]  # one kept for a relaunch
        assert replacement.pid != spare.pid
        assert (tmp_path / "logs" / "ps-0.pid").read_text().strip() == str(spare.pid)
    finally:
        backend.stop_all()
    assert replacement.poll() is not None  # spares end with the job
    log = (tmp_path / "logs" / "ps-0.log").read_text()
    assert "a warm spare" in log and "serving on" in log


def test_a_spare_that_is_not_needed_leaves_quietly_and_a_wrong_role_is_named():
    unused = subprocess.run([sys.executable, "-m", "elasticdl.launch.warm", "ps"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert (unused.returncode, unused.stdout, unused.stderr) == (0, "", "")  # EOF: no command line came
    wrong = subprocess.run([sys.executable, "-m", "elasticdl.launch.warm", "master"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "usage: python -m elasticdl.launch.warm {ps,worker}" in wrong.stderr


def test_workers_from_warm_spares_train_and_a_killed_one_is_replaced_by_a_spare(digits, tmp_path):  # noqa: F811
    job = "warm-join"
    proc = _start(digits, tmp_path, job, num_workers=1, num_ps=1, num_epochs=2, records_per_task=64)
    logs = tmp_path / "runs" / job / "logs"
    try:
        _wait_for(lambda: "first gradient pushed" in _read(logs / "worker-0.log"), 120, "worker 0's first gradient")
        os.kill(_worker_pids(proc.pid, tmp_path)[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = report_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert report["records_done_per_epoch"] == [report["records_per_epoch"]] * 2
    assert report["exactly_once"]["holds"], report["exactly_once"]
    assert "worker 1 started" in _master_log(tmp_path, job)
    for worker in (0, 1):  # the first worker and its replacement both came from a warm spare
        assert "since its warm spare got its command line" in _read(logs / f"worker-{worker}.log")


def _read(path) -> str:
    return path.read_text() if path.exists() else ""
