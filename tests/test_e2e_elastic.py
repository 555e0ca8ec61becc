"""End to end: workers killed, preempted and scaled while a job trains; a PS killed and restored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.hung_job import communicate_or_explain
from tests.test_e2e_local import _alive, _children_of, digits, report_of, train_args  # noqa: F401


def _role_pids(job_pid: int, tmp_path, role: str) -> dict[int, int]:
    """index -> pid of the job's live processes of ``role``: the local backend writes each
    one's pid beside its log (a warm spare's command line names no index)."""
    children = set(_alive(_children_of(job_pid)))
    found = {}
    for path in tmp_path.glob(f"runs/*/logs/{role}-*.pid"):
        pid = int(path.read_text())
        if pid in children:
            found[int(path.stem.rsplit("-", 1)[1])] = pid
    return found


def _worker_pids(job_pid: int, tmp_path) -> dict[int, int]:
    return _role_pids(job_pid, tmp_path, "worker")


def _ps_pids(job_pid: int, tmp_path) -> list[int]:
    """The pids of the job's live PS, in PS id order."""
    pids = _role_pids(job_pid, tmp_path, "ps")
    return [pids[i] for i in sorted(pids)]


def _report_after_ps_kill(proc: subprocess.Popen, tmp_path, ready, what: str, ps: int, wait: float = 120) -> dict:
    """Once ``ready()`` holds (``what``, within ``wait`` s), SIGKILL PS ``ps`` of the job ``proc``
    runs; its report once it ends."""
    try:
        _wait_for(ready, wait, what)
        os.kill(_ps_pids(proc.pid, tmp_path)[ps], signal.SIGKILL)
        out, err = communicate_or_explain(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    return report_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _master_log(tmp_path, job: str) -> str:
    path = tmp_path / "runs" / job / "logs" / "master.log"
    return path.read_text() if path.exists() else ""


def _start(digits, tmp_path, job: str, **flags) -> subprocess.Popen:  # noqa: F811
    args = train_args(digits, "digits.digits_functional.custom_model", job_name=job, **flags)
    return subprocess.Popen(
        [sys.executable, "-m", "elasticdl", *args], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def _scale(tmp_path, job: str, n: int) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "scale", "--job_name", job, "--num_workers", str(n)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"to {n} workers" in result.stdout


@pytest.mark.warm_spares
def test_chaos_kill_preempt_scale(digits, tmp_path):  # noqa: F811
    job = "chaos"
    proc = _start(digits, tmp_path, job, num_workers=3, num_ps=1, num_epochs=6, records_per_task=64)
    try:
        _wait_for(lambda: "epoch 2 of 6 starts" in _master_log(tmp_path, job), 120, "epoch 2")
        workers = _wait_for(lambda: len(_worker_pids(proc.pid, tmp_path)) == 3 and _worker_pids(proc.pid, tmp_path), 30, "3 workers")
        os.kill(workers[0], signal.SIGKILL)  # hard failure: its in-flight task goes back whole
        os.kill(workers[1], signal.SIGTERM)  # preemption: finishes its batch, reports, leaves
        _wait_for(lambda: "worker 4 started" in _master_log(tmp_path, job), 60, "two replacements")
        _scale(tmp_path, job, 1)
        _wait_for(lambda: len(_worker_pids(proc.pid, tmp_path)) == 1, 60, "scale down to 1 worker")
        started = _master_log(tmp_path, job).count(" started (")
        _scale(tmp_path, job, 3)
        # Two more workers started, by the master's log: they may leave again at once if
        # the job runs out of tasks, so their processes are not what is waited for.
        _wait_for(lambda: _master_log(tmp_path, job).count(" started (") >= started + 2, 60, "scale up to 3 workers")
        out, err = communicate_or_explain(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = report_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert report["metrics"]["accuracy"] >= 0.90
    # Every record of every epoch was trained.
    assert report["records_done_per_epoch"] == [report["records_per_epoch"]] * 6
    # Every record's gradient applied once per epoch, as the PS count them: the SIGKILL'd
    # worker's task went back from the PS's marks, the preempted one from its report.
    assert report["exactly_once"]["holds"], report["exactly_once"]
    # Only the SIGKILL'd worker's task was (partly) trained twice: at most one task's records.
    assert sum(report["records_trained_twice"]) <= 64
    assert report["worker_preemptions"] >= 2  # the killed and the preempted worker were replaced
    assert report["worker_relaunches"] == 0  # neither counted as a crash
    log = _master_log(tmp_path, job)
    assert "asking worker" in log and "scale-down" in log
    # The first workers and the later ones (replacements, scale-up) came from warm spares
    # (elasticdl/launch/warm.py): the backend keeps one ready once its first ones are used.
    # (A later one stopped by the scale-down before its first gradient logs no such line.)
    logs = tmp_path / "runs" / job / "logs"
    from_spares = {int(p.stem.split("-")[1]) for p in logs.glob("worker-*.log")
                   if "since its warm spare got its command line" in p.read_text()}
    assert 0 in from_spares and max(from_spares) >= 3, from_spares


def test_ps_killed_and_restored_from_checkpoint(digits, tmp_path):  # noqa: F811
    job = "ps-chaos"
    proc = _start(digits, tmp_path, job, num_workers=2, num_ps=1, num_epochs=3,
                  checkpoint_dir=tmp_path / "ckpt", checkpoint_steps=20)
    report = _report_after_ps_kill(proc, tmp_path, lambda: os.path.isdir(tmp_path / "ckpt" / "version-40"),
                                   "a checkpoint", ps=0)
    assert report["ps_relaunches"] == 1
    assert report["metrics"]["accuracy"] >= 0.90
    assert "every PS goes back to version" in _master_log(tmp_path, job)
    # The report names the rollback: the checkpoint version the PS went back to, and from where
    # (a cut every 20 versions, or the one the master asks at each epoch's end).
    (rollback,) = report["ps_rollbacks"]
    assert rollback["ps"] == 0 and rollback["to_version"] >= 40
    assert rollback["from_version"] >= rollback["to_version"]
    # Nothing lost, nothing applied twice: the PS applied exactly the records of 3 epochs.
    assert report["exactly_once"] == {"records_applied": [3 * 1437], "records_done": 3 * 1437, "holds": True}
    assert sum(epoch.get("rollback", 0) for epoch in report["records_retrained"]) == rollback["records_retrained"]


def test_a_worker_frozen_for_good_loses_its_task_at_the_timeout_and_is_replaced(digits, tmp_path):  # noqa: F811
    """A worker SIGSTOPped mid-job and never continued holds its task (and, in sync mode, the
    version the other worker waits on) until --task_timeout: then the master takes the task back,
    fenced on the PS, replaces the worker, and the job ends with every record applied once. (From
    the commit that made the ledger pure until this test, the job never gave its ledger a clock:
    no task ever timed out, and a frozen worker held its task for good.)"""
    job = "frozen"
    proc = _start(digits, tmp_path, job, num_workers=2, num_ps=1, num_epochs=1, records_per_task=64, task_timeout=8)
    frozen = None
    try:
        logs = tmp_path / "runs" / job / "logs"
        _wait_for(lambda: all("first gradient pushed" in p.read_text() for p in logs.glob("worker-[01].log"))
                  and len(list(logs.glob("worker-[01].log"))) == 2, 120, "both workers' first gradient")
        frozen = _wait_for(lambda: _worker_pids(proc.pid, tmp_path).get(0), 30, "worker 0's pid")
        os.kill(frozen, signal.SIGSTOP)
        out, err = communicate_or_explain(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        if frozen is not None and _alive([frozen]):
            os.kill(frozen, signal.SIGKILL)
    report = report_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert report["records_done_per_epoch"] == [report["records_per_epoch"]]
    assert report["exactly_once"]["holds"], report["exactly_once"]
    log = _master_log(tmp_path, job)
    assert "worker 0 held it longer than --task_timeout=8s" in log, log[-3000:]
    assert "its task timed out (--task_timeout)" in log, log[-3000:]
