"""End to end: a PS SIGKILLed in an async job, at a checkpoint event (issue 25).

The job rolls every PS back to the cut; the worker reconnects and must pull before it pushes
again. Before the fix every push after the rollback was refused ("gradient computed on version
-1"), its task dropped, and the job failed (6 of 6 runs). Checked as the chaos harness checks a
sync job (tests/chaos/test_exactly_once.py): the job succeeds, every record of every epoch was
trained, and every PS applied exactly the records the ledger counts as done.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.chaos.test_exactly_once import _check_lineages, _complete_cut
from tests.test_e2e_elastic import _report_after_ps_kill
from tests.test_e2e_local import digits, train_args  # noqa: F401

# Small batches make an epoch 180 versions long: the PS dies right after the cut at version
# STEPS, while the worker trains (computes or pushes), far from the epoch's end and its
# evaluation (a PS killed during an evaluation task never showed the bug).
EPOCHS, BATCH, STEPS = 2, 8, 40


@pytest.mark.parametrize("flags", [{}, {"staleness_bound": 2}], ids=["async", "ssp"])
def test_an_async_job_survives_a_ps_sigkill_with_exactly_once_holding(digits, tmp_path, flags):  # noqa: F811
    command = [sys.executable, "-m", "elasticdl", *train_args(
        digits, "digits.digits_functional.custom_model", job_name="async-ps-kill", num_workers=1, num_ps=2,
        num_epochs=EPOCHS, minibatch_size=BATCH, records_per_task=128, checkpoint_dir=tmp_path / "ckpt",
        checkpoint_steps=STEPS, use_async="true", **flags,
    )]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = _report_after_ps_kill(proc, tmp_path, lambda: _complete_cut(tmp_path, STEPS), "the first complete cut",
                                   ps=1)
    records = report["records_per_epoch"]
    assert report["status"] == "succeeded"
    assert report["records_done_per_epoch"] == [records] * EPOCHS
    assert report["exactly_once"] == {
        "records_applied": [EPOCHS * records] * 2, "records_done": EPOCHS * records, "holds": True,
    }
    (rollback,) = report["ps_rollbacks"]
    assert rollback["ps"] == 1 and rollback["to_version"] >= STEPS and rollback["records_possibly_missing"] == 0
    assert sum(e.get("rollback", 0) for e in report["records_retrained"]) == rollback["records_retrained"]
    _check_lineages(tmp_path)
