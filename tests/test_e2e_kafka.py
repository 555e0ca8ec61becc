"""End to end: `elasticdl train` on a Kafka stream (a real broker: tests/kafka_fixture.py).

N digits examples (the bundled generator's, fixed seed) go into a 2-partition topic; 2 workers
and 1 PS train on them until --stream_idle_secs passes with no new record. Checked from the
outside as the chaos harness checks a file job: the job succeeds, and the PS's own count of
records applied, read from the final checkpoint's files, is N: every record exactly once. Then
the same with a worker SIGKILLed mid-stream.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from kafka_fixture import kafka_broker  # noqa: F401  (pytest finds fixtures by name)

from elasticdl.data import tfrecord
from elasticdl.data.kafka_client import GroupOffsets, KafkaTopic
from tests.chaos.checks import final_cut
from tests.hung_job import communicate_or_explain
from tests.test_e2e_elastic import _master_log, _wait_for, _worker_pids
from tests.test_e2e_local import MODEL_ZOO, digits  # noqa: F401

TOPIC, PARTITIONS, RECORDS_PER_TASK = "digits", 2, 64


def _digits_records(digits_dir, n: int) -> list[bytes]:
    """The first ``n`` records of the digits training data (serialized tf.train.Example)."""
    records: list[bytes] = []
    for path in sorted((digits_dir / "train").iterdir()):
        records += tfrecord.read_records(path, 0, tfrecord.count_records(path))
        if len(records) >= n:
            break
    records = records[:n]
    assert len(records) == n, f"the digits data holds {len(records)} records, the test wants {n}"
    return records


def _produce_digits(broker, digits_dir, n: int) -> None:
    broker.create_topic(TOPIC, PARTITIONS)
    broker.produce(TOPIC, _digits_records(digits_dir, n), partitions=PARTITIONS)


def _trickle(broker, records: list[bytes], per_batch: int, every: float,
             slow_until: threading.Event | None = None) -> threading.Thread:
    """A producer writing ``records`` while the job runs, ``per_batch`` every ``every`` s; until
    ``slow_until`` is set, one at a time (the stream stays open, however long the job takes to start)."""
    def produce() -> None:
        pace = threading.Event()
        i = 0
        while i < len(records):
            step = per_batch if slow_until is None or slow_until.is_set() else 1
            broker.produce(TOPIC, records[i:i + step], partitions=PARTITIONS)
            i += step
            pace.wait(every)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    return thread


def _train(broker, tmp_path, job: str, **flags) -> subprocess.Popen:
    args = [
        "train", "--model_zoo", MODEL_ZOO, "--model_def", "digits.digits_functional.custom_model",
        "--training_data", f"kafka://{broker.bootstrap}/{TOPIC}", "--job_name", job,
        "--num_workers", "2", "--num_ps", "1", "--minibatch_size", "32",
        "--records_per_task", str(RECORDS_PER_TASK),
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--checkpoint_steps", "10",
    ]
    flags = {"stream_idle_secs": 3, **flags}
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return subprocess.Popen([sys.executable, "-m", "elasticdl", *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, tmp_path, job: str) -> dict:
    """The job's report once it ends; a job that does not end fails the test with every role's
    log tail and stack (tests/hung_job.py), before pytest's own timeout kills it blind."""
    out, err = communicate_or_explain(proc, tmp_path)
    assert proc.returncode == 0, err[-4000:]
    return json.loads((tmp_path / "runs" / job / "report.json").read_text())


def _assert_exactly_once(report: dict, tmp_path, n: int) -> None:
    assert report["status"] == "succeeded"
    assert report["records_done_per_epoch"] == [n]
    assert report["exactly_once"] == {"records_applied": [n], "records_done": n, "holds": True}
    directory, shards = final_cut(str(tmp_path / "ckpt"))  # the PS's own count, from its file
    assert [s.records_applied for s in shards] == [n], directory


def test_elasticdl_stop_ends_a_stream_job_with_its_checkpoint_export_and_report(kafka_broker, digits, tmp_path):  # noqa: F811
    _produce_digits(kafka_broker, digits, 600)
    job = "kafka-stop"
    proc = _train(kafka_broker, tmp_path, job, stream_idle_secs=0, output=tmp_path / "model")  # no idle end
    try:
        _wait_for(lambda: any((tmp_path / "ckpt").glob("version-*")), 180, "a first checkpoint")
        stop = subprocess.run([sys.executable, "-m", "elasticdl", "stop", "--job_name", job], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        asked = time.monotonic()
        assert stop.returncode == 0, stop.stderr[-2000:]
        assert f"stopping job {job}: the tasks in progress finish" in stop.stdout
        report = _finish(proc, tmp_path, job)
        took = time.monotonic() - asked
    except BaseException:
        proc.kill()
        raise
    done = report["records_done_per_epoch"][0]
    assert 0 < done <= 600 and report["saved_model"] and os.path.isdir(report["saved_model"])
    _assert_exactly_once(report, tmp_path, done)
    assert took < 30, f"the job took {took:.1f} s to end after `elasticdl stop`"
    assert "training stopped" in _master_log(tmp_path, job)


def test_a_stream_job_trains_every_record_once_and_ends_when_idle(kafka_broker, digits, tmp_path):  # noqa: F811
    n = 1000
    _produce_digits(kafka_broker, digits, n)
    job = "kafka-stream"
    report = _finish(_train(kafka_broker, tmp_path, job, window_records=300, kafka_group="trainer"), tmp_path, job)
    _assert_exactly_once(report, tmp_path, n)
    # Progressive validation: every record scored once (no task was trained twice here), in windows
    # of whole tasks of at least 300 records but the last; the model learns as the stream goes.
    windows = report["progressive"]
    assert sum(w["records"] for w in windows) == n and len(windows) >= 2
    assert all(w["records"] >= 300 for w in windows[:-1])
    assert [w["first_record"] for w in windows] == [sum(w["records"] for w in windows[:i]) for i in range(len(windows))]
    assert windows[-1]["metrics"]["accuracy"] > windows[0]["metrics"]["accuracy"]
    log = _master_log(tmp_path, job)
    assert "no new record for 3 s (--stream_idle_secs)" in log
    stream = report["stream"]
    assert stream["closed"] == "no new record for 3 s (--stream_idle_secs)" and stream["records_cut"] == n
    half = n // 2  # lag: seen minus consumed, 0 once every record seen is trained
    assert stream["partitions"] == {p: {"start": 0, "cut_to": half, "consumed": half, "seen": half, "lag": 0}
                                    for p in ("0", "1")} and stream["lag"] == 0
    # --kafka_group: a lag monitor sees every record consumed, as the ledger holds them.
    monitor = GroupOffsets(KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/{TOPIC}").address, "trainer")
    try:
        assert monitor.committed([0, 1]) == {int(p): v["cut_to"] for p, v in stream["partitions"].items()}
    finally:
        monitor.close()


def test_a_worker_sigkill_mid_stream_keeps_every_record_once(kafka_broker, digits, tmp_path):  # noqa: F811
    n = 1400
    records = _digits_records(digits, n)
    kafka_broker.create_topic(TOPIC, PARTITIONS)
    kafka_broker.produce(TOPIC, records[:600], partitions=PARTITIONS)
    job = "kafka-worker-kill"
    output = tmp_path / "serving"
    proc = _train(kafka_broker, tmp_path, job, task_timeout=60, output=output, export_every_secs=3, keep_exports=3)
    # Before and during the job: one record a 0.5 s until training is under way (however long a
    # loaded machine takes to start the workers), then 20.
    under_way = threading.Event()
    producer = _trickle(kafka_broker, records[600:], per_batch=20, every=0.5, slow_until=under_way)
    try:
        # Once training is under way (a first checkpoint cut), a worker dies hard mid-task.
        _wait_for(lambda: any((tmp_path / "ckpt").glob("version-*")), 180, "a first checkpoint")
        under_way.set()
        workers = _wait_for(lambda: _worker_pids(proc.pid, tmp_path), 30, "the workers' pids")
        os.kill(workers[min(workers)], signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    report = _finish(proc, tmp_path, job)
    producer.join()
    _assert_exactly_once(report, tmp_path, n)
    log = _master_log(tmp_path, job)
    # Mid-stream: the worker died while records were still arriving (before the stream closed).
    # (Its death, not its task's requeue: killed between two tasks, it held none.)
    assert log.index(f"worker-{min(workers)} exited (exit code -9)") < log.index("the stream is closed")
    _assert_exports(report, output, keep=3)


def _assert_exports(report: dict, output, keep: int) -> None:
    """--export_every_secs: versioned exports while the stream ran, the newest ``keep`` on disk,
    each a whole SavedModel; the last one is the final model; each has its freshness."""
    import tensorflow as tf

    exports = report["exports"]["list"]
    assert len(exports) >= keep and exports[-1]["final"] and not any(e["final"] for e in exports[:-1])
    versions = [e["version"] for e in exports]
    assert versions == sorted(set(versions)) and versions[-1] == report["model_version"]
    assert report["saved_model"] == str(output / str(versions[-1]))
    assert sorted(os.listdir(output), key=int) == [str(v) for v in versions[-keep:]]  # no temporary left
    for version in versions[-keep:]:
        loaded = tf.saved_model.load(str(output / str(version)))
        assert "serving_default" in loaded.signatures
    records = [e["records"] for e in exports]
    assert records == sorted(records) and records[-1] == report["records_done_per_epoch"][0]
    assert all(e["freshness_secs"] is not None and e["freshness_secs"] >= 0 for e in exports)
    assert report["exports"]["median_freshness_secs"] is not None


def test_a_master_sigkilled_mid_stream_resumes_from_the_ledgers_offsets(kafka_broker, digits, tmp_path,  # noqa: F811
                                                                         etcd_process):
    """The ledger in etcd holds the offsets cut; the master run again goes on from them (records
    cut after the last checkpoint go back to todo from the cut's marks), while records still arrive.
    etcd itself is SIGKILLed with the master and restarted from its data directory (issue 27's
    acceptance: a master SIGKILL plus an etcd restart mid-stream)."""
    n = 1400
    records = _digits_records(digits, n)
    kafka_broker.create_topic(TOPIC, PARTITIONS)
    kafka_broker.produce(TOPIC, records[:600], partitions=PARTITIONS)
    job = "kafka-master-kill"
    flags = {"etcd_endpoints": etcd_process.endpoint}
    first = _train(kafka_broker, tmp_path, job, **flags)
    producer = _trickle(kafka_broker, records[600:], per_batch=20, every=0.5)
    try:
        _wait_for(lambda: any((tmp_path / "ckpt").glob("version-*/ps-0-of-1*.npz")), 180, "a first complete cut")
        etcd_process.kill()  # the store dies hard too, mid-stream
        first.kill()  # the master dies hard; its PS and workers die with it
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    etcd_process.start()  # the same data directory: the ledger is what etcd had made durable
    report = _finish(_train(kafka_broker, tmp_path, job, **flags), tmp_path, job)
    producer.join()
    assert report["resumed"]
    _assert_exactly_once(report, tmp_path, n)
    log = _master_log(tmp_path, job)
    assert "(the ledger's for [0, 1])" in log  # both partitions went on from the ledger's offsets


def test_a_topic_deleted_under_the_job_fails_it_clearly_after_saving_what_was_trained(kafka_broker, digits,  # noqa: F811
                                                                                        tmp_path):
    from confluent_kafka.admin import AdminClient

    _produce_digits(kafka_broker, digits, 1000)
    job = "kafka-deleted"
    proc = _train(kafka_broker, tmp_path, job, stream_idle_secs=0, output=tmp_path / "model",
                  kafka_group="trainer")
    try:
        _wait_for(lambda: any((tmp_path / "ckpt").glob("version-*")), 180, "a first checkpoint")
        admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
        for future in admin.delete_topics([TOPIC]).values():
            future.result(timeout=20)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-3000:]
    assert f"the topic '{TOPIC}' was deleted from {kafka_broker.bootstrap} while the job ran" in err
    assert "Traceback" not in err
    report = json.loads((tmp_path / "runs" / job / "report.json").read_text())
    assert report["status"] == "failed" and "was deleted" in report["error"]
    # Nothing trained is lost: the final checkpoint and export hold every record the ledger counts done.
    done = report["records_done_per_epoch"][0]
    assert report["exactly_once"]["holds"] and report["checkpoint"] and os.path.isdir(report["saved_model"])
    directory, shards = final_cut(str(tmp_path / "ckpt"))
    assert [s.records_applied for s in shards] == [done], directory
    assert "was deleted" in report["stream"]["closed"]
