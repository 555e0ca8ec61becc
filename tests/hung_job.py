"""What a test prints when a job it runs does not end: the tail of every role's log and, where
py-spy is installed, the Python stack of every process of the job. A hang seen once in CI is
then diagnosable from CI's output alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.etcd_fixture import tail_of
from tests.test_e2e_local import _alive, _children_of

# Below pytest-timeout's 300 s (pyproject.toml), so that the test, not the timeout, reports.
JOB_END_TIMEOUT = 200


def communicate_or_explain(proc: subprocess.Popen, tmp_path, timeout: float = JOB_END_TIMEOUT) -> tuple[str, str]:
    """``proc.communicate()``; if the job is still running after ``timeout`` s, kill it and fail
    with what it was doing."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        explanation = explain(proc.pid, tmp_path)
        still = "still running" if proc.poll() is None else f"exited {proc.returncode}, its output pipes still open"
        proc.kill()
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process it started holds its stderr open
            err = ""
        raise AssertionError(
            f"the job did not end within {timeout} s ({still})\n{explanation}\n--- its stderr (tail) ---\n"
            + "\n".join(err.splitlines()[-40:])) from None


def explain(job_pid: int, tmp_path) -> str:
    parts = []
    for log in sorted(tmp_path.glob("runs/*/logs/*.log")):
        parts.append(f"--- {log.name} (tail) ---\n{tail_of(str(log), 30)}")
    # Beside this interpreter first: `make test` runs the venv's pytest without the venv on PATH.
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    for pid in [job_pid, *_alive(_children_of(job_pid))]:
        if py_spy is None:
            parts.append(f"--- pid {pid}: no py-spy to dump its stacks ---")
            break
        dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        parts.append(f"--- py-spy dump --pid {pid} ---\n{dump.stdout}{dump.stderr}")
    return "\n".join(parts)
