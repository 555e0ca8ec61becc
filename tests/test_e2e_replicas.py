"""End to end (issue 26's acceptance run, shortened): 1 worker, 2 PS, --ps_replicas 1, sync
(and async without --checkpoint_dir), digits, ps-1 SIGKILLed mid-job. Its shard goes on from its backup on ps-0: the job succeeds at
the fault-free final version, nothing is rolled back or trained again, exactly once holds, and
the report lists the failover (docs/replicas.md)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

import pytest

from elasticdl.data.sources import count_records, resolve_data_files
from tests.chaos.test_exactly_once import _check_lineages, _complete_cut
from tests.test_e2e_elastic import _master_log, _ps_pids, _report_after_ps_kill, _wait_for
from tests.test_e2e_local import digits, train_args  # noqa: F401

EPOCHS, BATCH, RECORDS_PER_TASK, STEPS = 3, 32, 128, 40


def batches_per_epoch(digits) -> int:  # noqa: F811
    """Sync with one worker, fault-free: one version per batch; tasks are cut per file, and each
    file's last task (and its last batch) may be short."""
    batches = 0
    for path in resolve_data_files(str(digits / "train")):
        records = count_records(path)
        batches += sum(math.ceil(min(RECORDS_PER_TASK, records - start) / BATCH)
                       for start in range(0, records, RECORDS_PER_TASK))
    return batches


@pytest.mark.parametrize("mode", ["sync", "async-without-checkpoints", "sync-two-deaths", "sync-both-replicas-lost"])
def test_a_ps_sigkill_with_replicas_promotes_its_backup_and_rolls_nothing_back(digits, tmp_path, mode):  # noqa: F811
    job = "replicas-ps-kill"
    flags = ({"use_async": "true"} if mode.startswith("async")  # no --checkpoint_dir: nothing to roll back to
             else {"checkpoint_dir": tmp_path / "ckpt", "checkpoint_steps": STEPS})
    command = [sys.executable, "-m", "elasticdl", *train_args(
        digits, "digits.digits_functional.custom_model", job_name=job, num_workers=1, num_ps=2,
        ps_replicas=1, num_epochs=EPOCHS, minibatch_size=BATCH, records_per_task=RECORDS_PER_TASK, **flags,
    )]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "sync":  # killed after the cut at 2 * STEPS: in the second epoch, the worker training
        report = _report_after_ps_kill(proc, tmp_path, lambda: _complete_cut(tmp_path, 2 * STEPS), "a cut", ps=1)
    elif mode == "sync-two-deaths":  # ps-1 at the first cut; ps-0, leading both shards, once ps-1 caught up
        try:
            _wait_for(lambda: _complete_cut(tmp_path, STEPS), 120, "the first cut")
            os.kill(_ps_pids(proc.pid, tmp_path)[1], signal.SIGKILL)
        except BaseException:
            proc.kill()
            raise
        report = _report_after_ps_kill(proc, tmp_path, lambda: "caught up and backs up shards [0, 1]" in _master_log(
            tmp_path, job), "ps-1 caught up", ps=0)
    elif mode == "sync-both-replicas-lost":  # ps-1, then ps-0 before ps-1 came back: shard 1 has no replica left
        try:
            _wait_for(lambda: _complete_cut(tmp_path, 2 * STEPS), 120, "a cut")
            os.kill(_ps_pids(proc.pid, tmp_path)[1], signal.SIGKILL)
        except BaseException:
            proc.kill()
            raise
        report = _report_after_ps_kill(proc, tmp_path, lambda: True, "now", ps=0)
    else:
        report = _report_after_ps_kill(proc, tmp_path, lambda: "epoch 2 of 3 starts" in _master_log(tmp_path, job),
                                       "epoch 2", ps=1)
    records = report["records_per_epoch"]
    assert report["status"] == "succeeded"
    assert report["exactly_once"] == {
        "records_applied": [EPOCHS * records] * 2, "records_done": EPOCHS * records, "holds": True,
    }
    assert report["model_version"] == EPOCHS * batches_per_epoch(digits)  # the fault-free job's
    if mode == "sync-both-replicas-lost":  # as without replicas: back to the cut, nothing lost
        assert report["ps_rollbacks"] and all(r["to_version"] >= 2 * STEPS for r in report["ps_rollbacks"])
        _check_lineages(tmp_path)
        return
    assert report["ps_rollbacks"] == []
    assert sum(sum(v for k, v in e.items() if k != "epoch") for e in report["records_retrained"]) == 0, \
        report["records_retrained"]
    assert report["records_possibly_missing"] == 0
    if mode == "sync-two-deaths":  # the second death promoted ps-1's caught-up backups of both shards
        assert [(f["shard"], f["old_primary"], f["new_primary"]) for f in report["ps_failovers"]] == [
            (1, 1, 0), (0, 0, 1), (1, 0, 1)]
        _check_lineages(tmp_path)
        return
    (failover,) = report["ps_failovers"]
    assert (failover["shard"], failover["old_primary"], failover["new_primary"]) == (1, 1, 0)
    assert failover["version"] > 0 and failover["pause_seconds"] < 10
    if mode == "sync":
        assert failover["version"] >= 2 * STEPS
        _check_lineages(tmp_path)


def test_deepfm_with_replicas_loses_a_ps_and_goes_on_from_the_backup_s_tables(tmp_path):
    """The acceptance run's embedding variant, shortened: DeepFM (its tables' rows on the PS,
    made by lookups), 2 workers, 2 PS, --ps_replicas 1, ps-1 SIGKILLed in the second epoch: the
    backup on ps-0 holds the rows ps-1 made, nothing is rolled back or trained again."""
    from tests.test_e2e_deepctr import MODEL_ZOO

    sys.path.insert(0, MODEL_ZOO)
    try:
        from deepctr.generate_data import generate
    finally:
        sys.path.remove(MODEL_ZOO)
    data = tmp_path / "deepctr"
    generate(str(data), train_records=3000, test_records=500)
    job, epochs = "replicas-deepfm", 2
    command = [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO,
               "--model_def", "deepctr.deepfm.custom_model", "--training_data", str(data / "train"),
               "--num_workers", "2", "--num_ps", "2", "--ps_replicas", "1", "--minibatch_size", "64",
               "--records_per_task", "256", "--num_epochs", str(epochs), "--checkpoint_dir", str(tmp_path / "ckpt"),
               "--checkpoint_steps", "10", "--job_name", job]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = _report_after_ps_kill(proc, tmp_path, lambda: f"epoch 2 of {epochs} starts" in _master_log(tmp_path, job),
                                   "epoch 2", ps=1)
    assert report["status"] == "succeeded"
    records = report["records_per_epoch"]
    assert report["exactly_once"] == {
        "records_applied": [epochs * records] * 2, "records_done": epochs * records, "holds": True,
    }
    assert report["ps_rollbacks"] == [] and report["records_possibly_missing"] == 0
    assert sum(sum(v for k, v in e.items() if k != "epoch") for e in report["records_retrained"]) == 0, \
        report["records_retrained"]
    (failover,) = report["ps_failovers"]
    print(f"DeepFM with replicas: {report['seconds']:.1f}s, failover {failover}, tables {report['embedding_tables']}")
    assert (failover["shard"], failover["old_primary"], failover["new_primary"]) == (1, 1, 0)
    assert failover["version"] > 0 and failover["pause_seconds"] < 10
    assert all(table["rows"] > 0 for table in report["embedding_tables"].values()), report["embedding_tables"]
