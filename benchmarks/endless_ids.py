"""The ``endless_ids`` case: a table whose ids never stop arriving stays bounded (issue 28).

    python -m benchmarks --cases endless_ids            # 400,000 records; --quick: 40,000

The data (written here with a fixed seed), 8 ids a record in one table, as a click log has:
- 4 item ids from a fixed vocabulary of 1,000, seen all the time;
- 2 user ids from a window of 2,000 that slides forward through the id space: a user is active
  for 64,000 records, seen about 64 times, and then never again;
- 2 one-off ids (new crosses, say) from a window of 2,000 that slides one id a record: each is
  seen about twice, and carries nothing.
The label follows a known truth: the sum of its item and user ids' hidden weights (AUC 0.77
for the truth itself; ``model.fit`` of the same model gets 0.73). New ids keep coming: 362,000
distinct ids in 400,000 records, most of them one-off.

The same job runs twice, 1 worker and 2 PS, its tasks in the data's order (``--shuffle_tasks
false``: a log replayed as it happened; shuffled, a user's sightings would spread over the whole
run), on benchmarks/model_zoo/endless/clicks.py (a summed 32-wide Adam-trained
``elasticdl.layers.Embedding`` and a logistic output):
- ``unbounded``: every id keeps its row;
- ``bounded``: ``ttl_versions=64`` removes a row not updated for 64 versions (16,384 records),
  16 times the mean gap between two sightings of an active user.

Each job's PS processes are sampled for their resident memory (``/proc/<pid>/status``, VmRSS)
every 0.2 s while they train. The figures:
- RSS growth after the first quarter: the largest RSS of the run over the RSS when a quarter
  of the training time had passed, minus 1 (target: at most 10% with the bound; the unbounded
  job shows what the bound saves);
- AUC of each job on held-out records that follow the training data (the job's final
  evaluation): the bounded job within 0.005 of the unbounded one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.common import BENCH_MODEL_ZOO, child_env, job_report
from benchmarks.elastic_recovery import _die_with_this_process, _lines, _role_pids

ITEMS = 1_000
USER_WINDOW = 2_000
USER_SIGHTINGS = 64  # times a user is seen, on average, while it is active
ONE_OFF_WINDOW = 2_000
ONE_OFF_BASE = 10_000_000  # one-off ids start here, user ids at ITEMS
BATCH = 256
SIZES = {True: 40_000, False: 400_000}  # records, by --quick
HELD_OUT = 20_000
TTL_VERSIONS = 64
RUNS = {"unbounded": "ttl_versions=0", "bounded": f"ttl_versions={TTL_VERSIONS}"}


def _examples(ids: np.ndarray, labels: np.ndarray):
    from tensorflow.core.example import example_pb2, feature_pb2

    for row, label in zip(ids.tolist(), labels.tolist()):
        yield example_pb2.Example(features=feature_pb2.Features(feature={
            "ids": feature_pb2.Feature(int64_list=feature_pb2.Int64List(value=row)),
            "label": feature_pb2.Feature(int64_list=feature_pb2.Int64List(value=[label])),
        })).SerializeToString()


def write_data(out: str, records: int, seed: int = 0) -> tuple[str, str]:
    """(training directory, held-out directory): ``records`` records, then HELD_OUT more from
    where the window has got to (ids the training saw last)."""
    from elasticdl.data.tfrecord import write_records

    train, held_out = os.path.join(out, "train"), os.path.join(out, "held_out")
    if os.path.exists(os.path.join(held_out, "data.tfrecord")):
        return train, held_out
    rng = np.random.default_rng(seed)
    total = records + HELD_OUT
    at = np.arange(total)
    items = rng.integers(0, ITEMS, size=(total, 4))
    users = ITEMS + (at * 2 // USER_SIGHTINGS)[:, None] + rng.integers(0, USER_WINDOW, size=(total, 2))
    one_off = ONE_OFF_BASE + at[:, None] + rng.integers(0, ONE_OFF_WINDOW, size=(total, 2))
    ids = np.concatenate([items, users, one_off], axis=1)
    weights = rng.normal(0.0, 0.5, size=int(users.max()) + 1)  # the hidden truth of items and users
    logit = weights[ids[:, :6]].sum(axis=1)
    labels = (rng.random(total) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    for directory, part in ((train, slice(0, records)), (held_out, slice(records, total))):
        os.makedirs(directory, exist_ok=True)
        write_records(os.path.join(directory, "data.tfrecord"), _examples(ids[part], labels[part]))
    return train, held_out


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler:
    """The summed RSS of a job's PS processes, every ``period`` seconds, with its time."""

    def __init__(self, job_pid: int, logs: str, period: float = 0.2):
        self.job_pid, self.logs, self.period = job_pid, logs, period
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            pids = _role_pids(self.job_pid, self.logs, "ps")
            sizes = [_rss_mb(pid) for pid in pids.values()]
            if pids and None not in sizes:
                self.samples.append((time.monotonic(), sum(sizes)))


def rss_growth(samples: list[tuple[float, float]], trained_from: float, trained_to: float) -> dict:
    """RSS when a quarter of the training time had passed, the largest after it, and the growth."""
    during = [(t, mb) for t, mb in samples if trained_from <= t <= trained_to]
    if len(during) < 4:
        return {"rss_quarter_mb": None, "rss_max_mb": None, "growth": None}
    quarter_time = trained_from + (trained_to - trained_from) / 4
    quarter = next(mb for t, mb in during if t >= quarter_time)
    largest = max(mb for t, mb in during if t >= quarter_time)
    return {"rss_quarter_mb": round(quarter, 1), "rss_max_mb": round(largest, 1),
            "growth": round(largest / quarter - 1, 4)}


def _first_gradient_seen(logs: str) -> bool:
    return any("first gradient pushed" in line for line in _lines(os.path.join(logs, "worker-0.log")))


def run_job(name: str, model_params: str, train: str, held_out: str, workdir: str, timeout: float) -> dict:
    job = f"endless-{name}"
    logs = os.path.join(workdir, "runs", job, "logs")
    command = [sys.executable, "-m", "elasticdl", "train", "--model_zoo", BENCH_MODEL_ZOO,
               "--model_def", "endless.clicks.custom_model", "--model_params", model_params,
               "--training_data", train, "--validation_data", held_out, "--minibatch_size", str(BATCH),
               "--records_per_task", "4096", "--shuffle_tasks", "false", "--num_epochs", "1", "--num_workers", "1", "--num_ps", "2",
               "--job_name", job]
    out_path = os.path.join(workdir, f"{job}.out")
    with open(out_path, "w") as out, open(os.path.join(workdir, f"{job}.err"), "w") as err:
        proc = subprocess.Popen(command, cwd=workdir, env=child_env(), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_this_process)  # nosec B603
        try:
            with RssSampler(proc.pid, logs) as sampler:
                deadline = time.monotonic() + timeout
                trained_from = None
                while proc.poll() is None and time.monotonic() < deadline:
                    if trained_from is None and _first_gradient_seen(logs):
                        trained_from = time.monotonic()
                    time.sleep(0.2)
                trained_to = sampler.samples[-1][0] if sampler.samples else time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    report = job_report(out_path, proc.returncode, job)
    return {"auc": report["metrics"].get("auc"), "records": report.get("records_trained"),
            "tables": report.get("embedding_tables", {}), **rss_growth(sampler.samples, trained_from or trained_to, trained_to)}


def run_endless_ids(args, out_dir: str) -> dict:
    from benchmarks.runner import log

    workdir = os.path.join(out_dir, "endless_ids")
    records = SIZES[args.quick]
    train, held_out = write_data(os.path.join(workdir, "data"), records)
    log(f"endless_ids: {records} records, user and one-off ids in sliding windows, bounded by "
        f"ttl_versions={TTL_VERSIONS}")
    runs = {}
    for name, params in RUNS.items():
        runs[name] = run_job(name, params, train, held_out, workdir, args.timeout)
        log(f"endless_ids {name}: {runs[name]}")
    return {"runs": runs, "records": records}


def endless_rows(result: dict, growth_target: float, auc_target: float) -> tuple[list[dict], list[dict]]:
    from benchmarks.runner import _status_row, _target

    runs = result.get("runs", {})
    if set(runs) != set(RUNS):
        return [_status_row("endless_ids", "-", "error: see errors")], []
    rows = []
    for name, run in runs.items():
        for metric, value in (("PS RSS growth after the first quarter", run["growth"]), ("AUC", run["auc"])):
            rows.append({"case": "endless_ids", "model": f"{result['records']} records", "competitor": name,
                         "metric": metric, "median": value, "runs": [value], "ratio": None, "ratio_to": ""})
    gap = None if None in (runs["bounded"]["auc"], runs["unbounded"]["auc"]) else \
        round(abs(runs["bounded"]["auc"] - runs["unbounded"]["auc"]), 4)
    targets = [_target("endless_ids: bounded PS RSS growth after the first quarter", runs["bounded"]["growth"],
                       growth_target, at_most=True),
               _target("endless_ids: |AUC bounded - AUC unbounded|", gap, auc_target, at_most=True)]
    return rows, targets
