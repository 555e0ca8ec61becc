"""The chaos harness: real jobs, real faults, and invariants checked on what happened.

Each test runs a real job (real processes over real gRPC; a real etcd where named), injects
one fault at a moment chosen by an event (a complete checkpoint cut on disk, an epoch's
start in the master's log; never a fixed sleep), and checks the history afterwards:

- **exactly once**: every PS applied the gradients of exactly the records the ledger
  counts as done (``report["exactly_once"]``, counted by the PS themselves), and the
  records trained again are named in the report with their cause;
- **the fault-free version**: with 1 worker in sync mode a version is one batch, so the
  final model version must equal the job's batch count, as if nothing had happened (no
  batch lost, none applied twice by a retried push);
- **one lineage per cut**: every cut on disk holds the shard files of one term.
"""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys

from elasticdl.data.sources import count_records, make_shards, resolve_data_files
from tests.test_e2e_elastic import _master_log, _report_after_ps_kill, _wait_for
from tests.test_e2e_local import digits, report_of, train_args  # noqa: F401

EPOCHS, BATCH, RECORDS_PER_TASK, STEPS = 3, 32, 128, 40


def _batches(digits) -> int:  # noqa: F811
    """The job's batch count: every task is cut into minibatches on its own."""
    files = [(path, count_records(path)) for path in resolve_data_files(str(digits / "train"))]
    return EPOCHS * sum(math.ceil(shard.records / BATCH) for shard in make_shards(files, RECORDS_PER_TASK))


def _command(digits, tmp_path, job: str, **flags) -> list[str]:  # noqa: F811
    return [sys.executable, "-m", "elasticdl", *train_args(
        digits, "digits.digits_functional.custom_model", job_name=job, num_workers=1, num_ps=2,
        num_epochs=EPOCHS, records_per_task=RECORDS_PER_TASK, checkpoint_dir=tmp_path / "ckpt",
        checkpoint_steps=STEPS, **flags,
    )]


def _complete_cut(tmp_path, version: int) -> bool:
    return len(glob.glob(str(tmp_path / "ckpt" / f"version-{version}" / "ps-*-of-2*.npz"))) == 2


def _check_lineages(tmp_path) -> None:
    """No version directory mixes two terms' shard files of the same PS count into one cut."""
    for version_dir in glob.glob(str(tmp_path / "ckpt" / "version-*")):
        terms = {}
        for name in os.listdir(version_dir):
            match = re.match(r"ps-(\d+)-of-(\d+)(?:\.term-(\d+))?\.npz$", name)
            if match:
                terms.setdefault(int(match.group(3) or 0), set()).add(int(match.group(1)))
        if not terms:  # only the temporary files of a PS SIGKILLed while it wrote this cut
            leftovers = os.listdir(version_dir)
            assert leftovers and all(n.startswith(".") and n.endswith(".tmp") for n in leftovers), \
                (version_dir, leftovers)
            continue
        assert any(ids == {0, 1} for ids in terms.values()) or len(terms) == 1, (version_dir, terms)


def _check_history(report: dict, digits, records_per_epoch: int) -> None:  # noqa: F811
    assert report["exactly_once"] == {
        "records_applied": [EPOCHS * records_per_epoch] * 2, "records_done": EPOCHS * records_per_epoch,
        "holds": True,
    }
    assert report["model_version"] == _batches(digits), "the final version is not the fault-free job's"
    assert report["records_done_per_epoch"] == [records_per_epoch] * EPOCHS


def test_a_ps_sigkilled_mid_job_ends_at_the_fault_free_version(digits, tmp_path):  # noqa: F811
    job = "chaos-ps"
    proc = subprocess.Popen(_command(digits, tmp_path, job), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    report = _report_after_ps_kill(proc, tmp_path, lambda: _complete_cut(tmp_path, STEPS), "the first complete cut", ps=1)
    _check_history(report, digits, report["records_per_epoch"])
    (rollback,) = report["ps_rollbacks"]
    assert rollback["ps"] == 1 and rollback["to_version"] >= STEPS and rollback["records_possibly_missing"] == 0
    assert sum(e.get("rollback", 0) for e in report["records_retrained"]) == rollback["records_retrained"]
    _check_lineages(tmp_path)


def _kill_the_master_in_epoch_2(command: list[str], tmp_path, job: str) -> None:
    """Start the job and SIGKILL its master once epoch 2 started and a complete cut is on disk."""
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: "epoch 2 of 3 starts" in _master_log(tmp_path, job) and _complete_cut(tmp_path, STEPS),
                  180, "epoch 2 and a complete cut")
        first.kill()  # the master dies hard; its PS and worker die with it
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()


def test_a_master_sigkilled_and_restarted_with_etcd_ends_at_the_fault_free_version(
        digits, tmp_path, etcd_process):  # noqa: F811
    job = "chaos-master"
    command = _command(digits, tmp_path, job, etcd_endpoints=etcd_process.endpoint)
    _kill_the_master_in_epoch_2(command, tmp_path, job)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = report_of(result)
    assert report["resumed"]
    _check_history(report, digits, report["records_per_epoch"])
    assert "resumed at the checkpoint of version" in _master_log(tmp_path, job)
    _check_lineages(tmp_path)


def test_a_ps_sigkilled_without_checkpoints_is_refilled_and_the_report_counts_what_may_be_missing(
        digits, tmp_path):  # noqa: F811
    """No --checkpoint_dir: the PS comes back empty and a worker refills it. The loss is not
    repaired, but never silent: the report bounds it, and the model-side check fails."""
    job = "chaos-no-ckpt"
    command = [sys.executable, "-m", "elasticdl", *train_args(
        digits, "digits.digits_functional.custom_model", job_name=job, num_workers=1, num_ps=2,
        num_epochs=EPOCHS, records_per_task=RECORDS_PER_TASK,
    )]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = _report_after_ps_kill(proc, tmp_path, lambda: "epoch 2 of 3 starts" in _master_log(tmp_path, job),
                                   "epoch 2", ps=1)
    (rollback,) = report["ps_rollbacks"]
    assert rollback["to_version"] is None and rollback["records_possibly_missing"] > 0
    assert report["records_possibly_missing"] == rollback["records_possibly_missing"]
    check = report["exactly_once"]
    assert not check["holds"] and check["records_applied"][1] < check["records_done"] == check["records_applied"][0]
    assert "missing from its shard" in _master_log(tmp_path, job)


def test_a_ps_sigkilled_after_the_only_cut_was_damaged_starts_over_and_ends_at_the_fault_free_version(
        digits, tmp_path):  # noqa: F811
    """Chaos seed 48's class: the only complete cut damaged, then a PS killed. The PS used to come
    back empty, refilled from a worker's copy, while the ledger went on: its own count started
    over (exactly once broken) and the shards ended at different versions. Now every PS starts
    over at version 0 and the ledger from the start, and the checkpoint files prove it."""
    job = "chaos-start-over"
    proc = subprocess.Popen(_command(digits, tmp_path, job), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def the_only_cut_damaged() -> bool:
        if not _complete_cut(tmp_path, STEPS):
            return False
        (shard,) = glob.glob(str(tmp_path / "ckpt" / f"version-{STEPS}" / "ps-1-of-2*.npz"))
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        return True

    report = _report_after_ps_kill(proc, tmp_path, the_only_cut_damaged, "the first complete cut", ps=1)
    assert report["status"] == "succeeded"
    _check_history(report, digits, report["records_per_epoch"])
    (rollback,) = report["ps_rollbacks"]
    assert rollback["to_version"] == 0 and rollback["records_possibly_missing"] == 0
    assert report["records_possibly_missing"] == 0
    assert "every parameter server starts again from version 0" in _master_log(tmp_path, job)
    # The final cut the report names is on disk, complete, at the report's version.
    assert report["checkpoint"].endswith(f"version-{report['model_version']}")
    assert _complete_cut(tmp_path, report["model_version"])
    _check_lineages(tmp_path)


def test_a_master_resumed_with_every_cut_damaged_trains_every_record_again(digits, tmp_path, etcd_process):  # noqa: F811
    """The master SIGKILLed, then every cut on disk damaged: the resumed master finds no usable
    cut although checkpoints are kept. Its ledger used to keep the done records, counted as
    possibly missing and in no model; the recovery policy now starts over from the start."""
    job = "chaos-master-start-over"
    command = _command(digits, tmp_path, job, etcd_endpoints=etcd_process.endpoint)
    _kill_the_master_in_epoch_2(command, tmp_path, job)
    shards = glob.glob(str(tmp_path / "ckpt" / "version-*" / "ps-*.npz"))
    assert shards
    for shard in shards:
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = report_of(result)
    assert report["resumed"] and report["records_possibly_missing"] == 0
    _check_history(report, digits, report["records_per_epoch"])
    assert "the job trains every record again from the start" in _master_log(tmp_path, job)
    assert report["checkpoint"].endswith(f"version-{report['model_version']}")
    _check_lineages(tmp_path)
