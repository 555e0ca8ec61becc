"""End to end with a real etcd: a second master is refused, outages pass, a partitioned master stops.

A killed master resuming from etcd is tests/chaos/test_exactly_once.py's (with the model-side checks)."""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

from tests.test_e2e_elastic import _master_log, _wait_for
from tests.test_e2e_local import digits, report_of, train_args  # noqa: F401


def _command(digits, tmp_path, etcd, job: str, **flags) -> list[str]:  # noqa: F811
    return [sys.executable, "-m", "elasticdl", *train_args(
        digits, "digits.digits_functional.custom_model", job_name=job, etcd_endpoints=etcd,
        num_workers=2, num_ps=1, **flags,
    )]


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _run(command, tmp_path) -> dict:
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return report_of(result)


def test_second_master_for_the_same_job_is_refused(digits, tmp_path, etcd_process):  # noqa: F811
    command = _command(digits, tmp_path, etcd_process.endpoint, "twice", num_epochs=200)
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: "job state in etcd" in _master_log(tmp_path, "twice"), 120, "the first master")
        second = subprocess.run(command, cwd=tmp_path / "..", capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert "another master" in second.stderr and "/elasticdl/twice/master" in second.stderr
        assert first.poll() is None  # the first one is unharmed
    finally:
        first.kill()
        first.wait(10)


def test_etcd_outage_mid_job(digits, tmp_path, etcd_process):  # noqa: F811
    command = _command(digits, tmp_path, etcd_process.endpoint, "outage", num_epochs=4)
    job = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: "epoch 2 of 4 starts" in _master_log(tmp_path, "outage"), 180, "epoch 2")
        etcd_process.stop()
        # The outage's length is what is under test: well below the master's renew deadline
        # (2/3 of its 10 s lease), which etcd's own restart adds to on a loaded machine.
        time.sleep(1.5)
        etcd_process.start()
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    report = report_of(subprocess.CompletedProcess(job.args, job.returncode, out, err))
    assert report["etcd_outages"] and report["etcd_outages"][0]["seconds"] > 0
    assert report["records_done_per_epoch"] == [report["records_per_epoch"]] * 4
    assert report["exactly_once"]["holds"], report["exactly_once"]
    assert report["metrics"]["accuracy"] >= 0.90


def test_a_master_cut_off_from_etcd_stops_before_another_can_lead(digits, tmp_path, etcd_process):  # noqa: F811
    """The TCP path between the master and etcd is cut (etcd itself keeps running): the master
    stops acting within its renew deadline and exits 1; a second master takes the lock only
    after the first one is gone, resumes its ledger and finishes the job."""
    from tests.tcp_proxy import TcpProxy
    from tests.test_e2e_elastic import _worker_pids

    host, port = etcd_process.endpoint.rsplit(":", 1)
    proxy = TcpProxy((host, int(port)))
    ckpt = {"checkpoint_dir": tmp_path / "ckpt", "checkpoint_steps": 50, "keep_checkpoint_max": 0}  # keep all
    command = _command(digits, tmp_path, proxy.endpoint, "partition", num_epochs=16, **ckpt)
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: "epoch 2 of 16 starts" in _master_log(tmp_path, "partition"), 180, "epoch 2")
        # The job must still be running when the renew deadline passes, however fast it trains:
        # its workers are paused with the cut and go on once the master has stopped acting.
        paused = list(_worker_pids(first.pid, tmp_path).values())
        assert paused
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        proxy.cut()
        cut_at = datetime.datetime.now()
        try:
            _wait_for(lambda: "lost the leader lock" in _master_log(tmp_path, "partition"), 60, "the lost lock")
        finally:
            for pid in paused:
                _continue(pid)
        _, err = first.communicate(timeout=60)
        first_gone = time.monotonic()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 1, err[-3000:]
    assert "could not renew its lease" in err and "stops acting" in err
    # The report lists the outage it ended in, as ongoing.
    with open(tmp_path / "runs" / "partition" / "report.json") as f:
        outages = json.load(f)["etcd_outages"]
    assert outages and outages[-1]["ongoing"] and outages[-1]["seconds"] > 0
    from elasticdl.master.job_state import LEADER_LEASE_SECS

    # It stopped acting before its lease could expire (its shutdown comes after: the PS and
    # workers are stopped, whose own leases then expire).
    line = next(x for x in _master_log(tmp_path, "partition").splitlines() if "lost the leader lock" in x)
    lost_at = datetime.datetime.combine(cut_at.date(), datetime.time.fromisoformat(line.split()[0]))
    assert 0 < (lost_at - cut_at).total_seconds() < LEADER_LEASE_SECS
    second_command = _command(digits, tmp_path, etcd_process.endpoint, "partition", num_epochs=16, **ckpt)
    started, started_wall = time.monotonic(), time.time()
    report = _run(second_command, tmp_path)
    assert started > first_gone  # never two masters acting at once
    assert report["resumed"] and report["records_done_per_epoch"] == [report["records_per_epoch"]] * 16
    assert report["exactly_once"]["holds"], report["exactly_once"]
    # Two lineages, one per term; none of the first term's shard files was written after the
    # second master started.
    by_term: dict[int, list[float]] = {}
    for path in glob.glob(str(tmp_path / "ckpt" / "version-*" / "ps-*.npz")):
        term = int(re.search(r"\.term-(\d+)\.npz$", path).group(1))
        by_term.setdefault(term, []).append(os.path.getmtime(path))
    assert len(by_term) == 2, sorted(by_term)
    first_term, second_term = sorted(by_term)
    assert max(by_term[first_term]) < started_wall < min(by_term[second_term])
