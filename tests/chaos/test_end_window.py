"""A PS killed as the job ends: after the last task, before the job saved the model.

The PS holds the only copy of what was trained since the last cut, so the job must not end on
it (before, it failed with an internal error at its final stats, or exported a lost shard).
The controller reopens the job (elasticdl/master/ps_losses.py): the PS comes back from the cut,
the workers that left start again and train what was rolled back, and the job ends as if nothing
had happened: the fault-free final version, every record applied once, by the PS's own counts.
"""

from __future__ import annotations

import os
import signal
import subprocess

from tests.chaos.test_exactly_once import _check_history, _check_lineages, _command
from tests.hung_job import communicate_or_explain
from tests.test_e2e_elastic import _master_log, _ps_pids, _wait_for
from tests.test_e2e_local import digits, report_of  # noqa: F401


def test_a_ps_killed_while_the_workers_leave_ends_at_the_fault_free_version(digits, tmp_path):  # noqa: F811
    job = "chaos-ps"
    proc = subprocess.Popen(_command(digits, tmp_path, job), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: "evaluating model version" in _master_log(tmp_path, job) and "(final)" in _master_log(
            tmp_path, job), 180, "the final evaluation")
        ps1 = _ps_pids(proc.pid, tmp_path)[1]  # before the job ends: still there
        _wait_for(lambda: "-> leaving" in _master_log(tmp_path, job), 60, "the workers leaving")
        os.kill(ps1, signal.SIGKILL)
        out, err = communicate_or_explain(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = report_of(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    log = _master_log(tmp_path, job)
    # Killed within 0.2 s of the workers starting to leave: almost always before the job took
    # its final stats and checkpoint (then it reopened). Killed after them, the job had saved the
    # model and stopped the PS: its death is then no event, and the checks below hold all the same.
    if "ps-1 died" in log:
        assert "before the model was saved" in log, "the job did not reopen"
    _check_history(report, digits, report["records_per_epoch"])
    assert report["checkpoint"].endswith(f"version-{report['model_version']}")
    _check_lineages(tmp_path)
