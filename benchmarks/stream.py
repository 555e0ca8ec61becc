"""Online training from Kafka against the same model on TFRecord files, and freshness.

    python -m benchmarks --cases stream            # (opt-in: not among the default cases)
    python -m benchmarks.stream --spec '{"records": 40000, "vocabulary": 1000000, "reps": 3, ...}'

A Tansu broker (tests/kafka_fixture.py: the Kafka-protocol broker of the tests, in memory, on
a free loopback port) holds the synthetic click records of the training case's DeepFM
(model_zoo/deepctr's generator, ids folded into ``vocabulary``), in a 4-partition topic; the
same records are in TFRecord files. Each repetition, in an order rotated between repetitions:

- ``tfrecord``: ``elasticdl train`` on the files, one epoch;
- ``kafka``: the same job on ``kafka://.../ctr`` (``--stream_idle_secs``), every record there
  before it starts.

Both are measured as the training case measures ElasticDL (benchmarks/training.py
``run_elasticdl``): records per second over the task reports after every worker's first.
The ratio is Kafka's over TFRecord's, paired by repetition (target: at least 0.9).

Then freshness, once: a producer writes records into a new topic at ``rate`` records per
second for ``seconds`` while the job trains with ``--export_every_secs``; the report's
exports give each one's freshness (its newest record's Kafka timestamp to the export's
completion). Target: the median at most twice ``--export_every_secs``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from benchmarks.common import BENCH_MODEL_ZOO, REPO, emit

PARTITIONS = 4
# Sizes (--quick: the smoke sizes) and the targets of issue 27.
SIZES = {
    False: {"records": 40_000, "vocabulary": 1_000_000, "batch_size": 256, "batches_per_task": 8,
            "num_workers": 2, "idle_secs": 3.0, "rate": 1000.0, "seconds": 40.0, "export_every_secs": 5.0},
    True: {"records": 2048, "vocabulary": 10_000, "batch_size": 64, "batches_per_task": 4,
           "num_workers": 1, "idle_secs": 3.0, "rate": 200.0, "seconds": 10.0, "export_every_secs": 2.0},
}
KAFKA_VS_TFRECORD = 0.9  # examples/s from Kafka over the same model from TFRecord, at least
FRESHNESS_PERIODS = 2.0  # median freshness at most this many --export_every_secs


# ---------------------------------------------------------------- the runner's side


def run_case(args, out_dir: str) -> dict:
    """The suite's ``--cases stream`` (benchmarks/runner.py): this module in a child process."""
    from benchmarks.common import ChildFailed, cores, run_child
    from benchmarks.runner import log

    spec = {**SIZES[args.quick], "reps": args.reps, "threads": args.threads or cores(), "workdir": out_dir}
    log(f"stream: DeepFM from a {spec['records']:,}-record Kafka topic against TFRecord files, {args.reps} "
        f"repetitions; then freshness at {spec['rate']:.0f} records/s")
    try:
        result = run_child("benchmarks.stream", spec, cwd=out_dir, timeout=args.timeout,
                           log_path=os.path.join(out_dir, "logs", "stream.log"))
    except ChildFailed as err:
        log(str(err))
        return {"runs": [], "errors": [str(err)]}
    return {**result, "errors": []}


def add_rows(stream: dict, rows: list, targets: list) -> None:
    """The case's table rows and targets."""
    from benchmarks.common import median, paired_ratios
    from benchmarks.runner import _status_row, _target

    if not stream["runs"]:
        rows.append(_status_row("stream", "-", "error: see errors"))
        return
    model = f"deepfm {stream['records']:,} records"
    kafka = [r["kafka"] for r in stream["runs"]]
    files = [r["tfrecord"] for r in stream["runs"]]
    ratio = median(paired_ratios(kafka, files))
    rows.append({"case": "stream", "model": model, "competitor": "elasticdl_kafka", "metric": "examples/s",
                 "median": median(kafka), "runs": kafka, "ratio": ratio, "ratio_to": "elasticdl_tfrecord"})
    rows.append({"case": "stream", "model": model, "competitor": "elasticdl_tfrecord", "metric": "examples/s",
                 "median": median(files), "runs": files, "ratio": None, "ratio_to": ""})
    fresh = stream["median_freshness_s"]
    rows.append({"case": "stream", "model": f"{stream['rate']:.0f} records/s live", "competitor": "elasticdl_kafka",
                 "metric": "freshness s", "median": fresh, "runs": [fresh], "ratio": None, "ratio_to": ""})
    targets.append(_target("stream: elasticdl_kafka / elasticdl_tfrecord", ratio, KAFKA_VS_TFRECORD))
    targets.append(_target(f"stream: median freshness (--export_every_secs {stream['export_every_secs']:g})", fresh,
                           FRESHNESS_PERIODS * stream["export_every_secs"], unit="s"))


# ---------------------------------------------------------------- the child


def _broker(log_dir: str):
    sys.path.insert(0, os.path.join(REPO, "tests"))  # the tests' broker fixture, outside pytest
    from kafka_fixture import KafkaBroker, require_broker_binary

    broker = KafkaBroker(require_broker_binary(), log_dir)
    broker.start()
    return broker


def _records(folder: str) -> list[bytes]:
    from elasticdl.data import tfrecord

    out: list[bytes] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        out += tfrecord.read_records(path, 0, tfrecord.count_records(path))
    return out


def _job(spec: dict, tag: str, data: str, records: int, flags: dict) -> dict:
    from benchmarks.training import run_elasticdl

    model = {"name": "deepfm", "model_zoo": BENCH_MODEL_ZOO, "model_def": "deepfm.deepfm_keras.custom_model",
             "model_params": f"vocabulary={spec['vocabulary']}", "data_dir": data, "records": records,
             "batch_size": spec["batch_size"], "epochs": 1,
             "job_flags": {"embedding_swap_threshold_mb": 0.0, **flags}}
    run = {"competitor": "elasticdl", "num_workers": spec["num_workers"], "use_async": True,
           "threads": spec["threads"], "warmup_batches": spec["batches_per_task"], "tag": tag, "models": [model]}
    return run_elasticdl(run)["deepfm"]


def _produce_paced(broker, topic: str, records: list[bytes], rate: float) -> threading.Thread:
    """Write ``records``: one every 0.5 s until the job trains (its first task report: the stream
    stays open, and the start-up does not pile up a backlog), then at about ``rate`` a second,
    in batches of a tenth of a second."""
    from benchmarks.training import _observe_task_reports

    reports = _observe_task_reports()
    reports.clear()  # the earlier jobs' (this process ran them)

    def produce() -> None:
        pace = threading.Event()
        i = 0
        while not reports and i < len(records):
            broker.produce(topic, records[i:i + 1], partitions=PARTITIONS)
            i += 1
            pace.wait(0.5)
        per_batch = max(1, int(rate / 10))
        started = time.monotonic()
        for n, j in enumerate(range(i, len(records), per_batch), 1):
            broker.produce(topic, records[j:j + per_batch], partitions=PARTITIONS)
            pace.wait(max(0.0, started + n * per_batch / rate - time.monotonic()))
    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    return thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(parser.parse_args().spec)
    from benchmarks.data import write_ctr

    work = tempfile.mkdtemp(prefix="bench-stream-", dir=spec.get("workdir"))
    files = os.path.join(work, "ctr")
    os.makedirs(files)
    write_ctr(files, spec["records"], spec["vocabulary"])
    records = _records(files)
    broker = _broker(work)
    try:
        broker.create_topic("ctr", PARTITIONS)
        broker.produce("ctr", records, partitions=PARTITIONS)
        runs = []
        for rep in range(spec["reps"]):
            order = [("tfrecord", files), ("kafka", f"kafka://{broker.bootstrap}/ctr")]
            order = order[rep % 2:] + order[:rep % 2]
            result = {}
            for name, data in order:
                flags = {"stream_idle_secs": spec["idle_secs"]} if name == "kafka" else {}
                result[name] = _job(spec, f"r{rep}-stream-{name}", data, len(records), flags)
                print(f"rep {rep + 1} {name}: {result[name]['examples_per_s']:.0f} examples/s", file=sys.stderr)
            runs.append({name: r["examples_per_s"] for name, r in result.items()})
        live = records[:int(spec["rate"] * spec["seconds"])]
        broker.create_topic("ctr-live", PARTITIONS)
        broker.produce("ctr-live", live[:spec["batch_size"]], partitions=PARTITIONS)  # the submit check's batch
        producer = _produce_paced(broker, "ctr-live", live[spec["batch_size"]:], spec["rate"])
        fresh = _job(spec, "stream-freshness", f"kafka://{broker.bootstrap}/ctr-live", len(live),
                     {"stream_idle_secs": spec["idle_secs"], "export_every_secs": spec["export_every_secs"],
                      "output": os.path.join(work, "serving")})
        producer.join()
        exports = fresh.get("exports") or {}
        emit({"runs": runs, "records": len(records), "export_every_secs": spec["export_every_secs"],
              "median_freshness_s": exports.get("median_freshness_secs"),
              "max_freshness_s": exports.get("max_freshness_secs"),
              "exports": len(exports.get("list", [])), "live_records": len(live), "rate": spec["rate"]})
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
