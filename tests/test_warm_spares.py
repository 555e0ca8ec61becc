"""Warm spares (elasticdl/launch/warm.py): real role processes that import their modules
before the local backend hands them a command line. Correctness only: what a spare-started
role does, not how fast it starts (docs/benchmarks.md measures that). Workers from spares,
first ones and replacements, train in tests/test_e2e_elastic.py's chaos test."""

from __future__ import annotations

import json
import subprocess
import sys

from elasticdl.config import JobConfig
from elasticdl.launch.local import LocalBackend
from elasticdl.rpc.ps_client import PSClient


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
        spare, kept = backend._spares["ps"]  # the one asked for, and the one kept for a relaunch
        backend.start("ps", 0, args)
        assert backend.pid("ps", 0) == spare.pid  # the spare, not a new process
        [address] = backend.ps_addresses(1, 60)
        ps = PSClient([address], token=backend.token())
        assert [s.version for s in ps.stats()] == [0]  # it serves, with the job's token
        ps.close()
        assert backend._spares["ps"] == [kept]  # still one kept: none started
        backend.start("ps", 1, [*args[:-1], "1"])  # a second PS (a relaunch would do the same)
        assert backend.pid("ps", 1) == kept.pid
        [replacement] = backend._spares["ps"]  # the kept one used: a replacement starts
        assert replacement.pid not in (spare.pid, kept.pid)
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


def test_a_role_that_exits_now_flushes_its_log_and_output_and_keeps_its_exit_code(tmp_path):
    """exit_now skips the interpreter's finalization (seconds with TensorFlow loaded), not what
    the role wrote: its buffered output and its log's last line are there."""
    log = tmp_path / "role.log"
    code = (
        "import logging, sys\n"
        f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
        "logging.info('the last line of the log')\n"
        "sys.stdout.write('buffered output')\n"
        "from elasticdl.launch.child import exit_now\n"
        "exit_now(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert result.stdout == "buffered output"
    assert "the last line of the log" in log.read_text()
