"""Issue 27's acceptance run, outside `make test` (minutes, and a job of 4 processes):

    .venv/bin/python tests/kafka_acceptance.py [--records 20000] [--out runs/kafka-acceptance]

A Tansu broker (tests/kafka_fixture.py) and a 4-partition topic. The synthetic click data of
model_zoo/deepctr (generate_data.py: a known ground truth) is produced into it, part before the
job and the rest while it runs. DeepFM trains on it online with 2 workers and 2 PS,
`--export_every_secs`, `--window_records` and `--kafka_group`. Once training is under way a PS
is SIGKILLed, and once it is back, a worker. The job ends after `--stream_idle_secs`. Then
the same model trains offline on the same records from TFRecord files, for the AUC to compare
with. It checks:

- exit 0; `exactly_once` holds, and the records applied, by each PS's own count in its final
  checkpoint, equal the records produced;
- at least 3 exports on disk, each loadable with `tf.saved_model.load`;
- the last export's AUC on the held-out split within 0.02 of the offline model's;
- progressive-validation windows in the report, and lag 0 at the end of every partition.

It prints a JSON summary and exits 1 when a check fails (each failure named).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
MODEL_ZOO = os.path.join(REPO, "model_zoo")
sys.path[:0] = [TESTS, REPO, MODEL_ZOO]

from kafka_fixture import KafkaBroker, require_broker_binary  # noqa: E402

from tests.chaos.checks import final_cut  # noqa: E402
from tests.test_e2e_elastic import _ps_pids, _worker_pids  # noqa: E402

TOPIC, PARTITIONS = "clicks", 4
AUC_TOLERANCE = 0.02


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {proc.returncode}) before {what}")
        time.sleep(0.2)  # polls other processes' files: a wait, no race
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def _train(out: str, job: str, data: str, extra: list[str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO,
            "--model_def", "deepctr.deepfm.custom_model", "--training_data", data, "--job_name", job,
            "--num_workers", "2", "--num_ps", "2", "--minibatch_size", "256", "--records_per_task", "1024",
            "--checkpoint_dir", os.path.join(out, job, "ckpt"), "--checkpoint_steps", "10", *extra]
    log = open(os.path.join(out, f"{job}.log"), "w")
    return subprocess.Popen(args, cwd=out, stdout=subprocess.PIPE, stderr=log, text=True)


def _auc_of(saved_model: str, ids: np.ndarray, labels: np.ndarray) -> float:
    import tensorflow as tf
    from deepctr.generate_data import auc

    serve = tf.saved_model.load(saved_model).signatures["serving_default"]
    scores = []
    for start in range(0, len(ids), 4096):
        out = serve(ids=tf.constant(ids[start:start + 4096], tf.int64))
        scores.append(next(iter(out.values())).numpy().ravel())
    return auc(labels, np.concatenate(scores))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--test_records", type=int, default=5_000)
    parser.add_argument("--before", type=float, default=0.4, help="the share produced before the job starts")
    parser.add_argument("--rate", type=float, default=300.0, help="records per second while it runs")
    parser.add_argument("--out", default=os.path.join("runs", "kafka-acceptance"))
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    from deepctr.generate_data import generate

    from elasticdl.data import tfrecord

    meta = generate(os.path.join(out, "data"), args.records, args.test_records)
    train_dir = os.path.join(out, "data", "train")
    records = []
    for name in sorted(os.listdir(train_dir)):
        path = os.path.join(train_dir, name)
        records += tfrecord.read_records(path, 0, tfrecord.count_records(path))
    from deepctr.generate_data import GroundTruth  # the held-out split, as generate drew it

    truth, rng = GroundTruth(0), np.random.default_rng(1)
    truth.sample(args.records, rng)
    test_ids, _, test_labels = truth.sample(args.test_records, rng)

    broker = KafkaBroker(require_broker_binary(), out)
    broker.start()
    problems: list[str] = []
    summary: dict = {"records": len(records), "auc_ceiling": meta["auc_ceiling"]}
    try:
        broker.create_topic(TOPIC, PARTITIONS)
        first = int(len(records) * args.before)
        broker.produce(TOPIC, records[:first], partitions=PARTITIONS)
        online = _train(out, "online", f"kafka://{broker.bootstrap}/{TOPIC}", [
            "--stream_idle_secs", "10", "--output", os.path.join(out, "online", "serving"),
            "--export_every_secs", "5", "--keep_exports", "5", "--window_records", "2000",
            "--kafka_group", "acceptance"])

        def produce() -> None:
            per_batch = max(1, int(args.rate / 5))
            pace = threading.Event()
            for i in range(first, len(records), per_batch):
                broker.produce(TOPIC, records[i:i + per_batch], partitions=PARTITIONS)
                pace.wait(0.2)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        ckpt = os.path.join(out, "online", "ckpt")
        try:
            _wait(lambda: any(len([f for f in os.listdir(os.path.join(ckpt, v)) if f.endswith(".npz")]) >= 2
                              for v in os.listdir(ckpt) if v.startswith("version-")) if os.path.isdir(ckpt) else 0,
                  600, "a first complete cut", online)
            ps = _wait(lambda: _ps_pids(online.pid, Path(out)), 60, "the PS pids", online)
            os.kill(ps[1], signal.SIGKILL)
            summary["ps_killed_at"] = time.time()
            _wait(lambda: (lambda p: len(p) == 2 and p[1] != ps[1] and p)(_ps_pids(online.pid, Path(out))), 300,
                  "the PS relaunched", online)
            workers = _wait(lambda: _worker_pids(online.pid, Path(out)), 60, "the workers' pids", online)
            os.kill(workers[min(workers)], signal.SIGKILL)
            summary["worker_killed_at"] = time.time()
            stdout, _ = online.communicate(timeout=1800)
        finally:
            if online.poll() is None:
                online.kill()
        producer.join()
        if online.returncode != 0:
            problems.append(f"the online job exited {online.returncode} (see {out}/online.log)")
        report = json.loads(open(os.path.join(out, "runs", "online", "report.json")).read())
        summary["online_seconds"] = report["seconds"]
        cut = final_cut(ckpt)
        applied = [s.records_applied for s in cut[1]] if cut else []
        summary["records_applied_per_ps"] = applied
        if not report["exactly_once"].get("holds") or set(applied) != {len(records)}:
            problems.append(f"exactly once: {report['exactly_once']}, the PS applied {applied} of {len(records)}")
        master_log = open(os.path.join(out, "runs", "online", "logs", "master.log")).read()
        killed = f"worker-{min(workers)} exited (exit code -9)"
        if report["ps_relaunches"] < 1 or killed not in master_log:
            problems.append(f"the faults did not happen: {report['ps_relaunches']} PS relaunches; "
                            f"{killed!r} {'in' if killed in master_log else 'not in'} the master's log")
        exports = (report.get("exports") or {}).get("list", [])
        serving = os.path.join(out, "online", "serving")
        on_disk = sorted(os.listdir(serving), key=int) if os.path.isdir(serving) else []
        summary["exports"] = len(exports)
        summary["exports_on_disk"] = on_disk
        summary["median_freshness_secs"] = (report.get("exports") or {}).get("median_freshness_secs")
        if len(on_disk) < 3:
            problems.append(f"{len(on_disk)} exports on disk, not at least 3")
        import tensorflow as tf

        for version in on_disk:
            tf.saved_model.load(os.path.join(serving, version))  # raises if one is not whole
        windows = report["progressive"]
        summary["progressive"] = [(w["records"], w["metrics"]) for w in windows]
        if not windows:
            problems.append("no progressive-validation window in the report")
        lags = {p: v["lag"] for p, v in (report.get("stream") or {}).get("partitions", {}).items()}
        summary["lag"] = lags
        if any(lags.values()):
            problems.append(f"lag at the end: {lags}")

        offline = _train(out, "offline", train_dir, ["--output", os.path.join(out, "offline", "model")])
        offline.communicate(timeout=1800)
        if offline.returncode != 0:
            problems.append(f"the offline job exited {offline.returncode} (see {out}/offline.log)")
        offline_report = json.loads(open(os.path.join(out, "runs", "offline", "report.json")).read())
        online_auc = _auc_of(report["saved_model"], test_ids, test_labels)
        offline_auc = _auc_of(offline_report["saved_model"], test_ids, test_labels)
        summary.update(online_auc=round(online_auc, 4), offline_auc=round(offline_auc, 4))
        if abs(online_auc - offline_auc) > AUC_TOLERANCE:
            problems.append(f"the last export's AUC {online_auc:.4f} is not within {AUC_TOLERANCE} of the "
                            f"offline model's {offline_auc:.4f}")
    finally:
        broker.stop()
    summary["problems"] = problems
    print(json.dumps(summary, indent=2, default=str))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
