"""Bad records fail loudly or are skipped by choice (--max_bad_records); training that turns
NaN fails: the readers, the search for the records to blame, the worker, the dispatcher and
the report. The controller's decisions are in test_controller.py, the preflight's in
test_preflight_data.py, whole jobs in test_e2e_bad_records.py."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from zoo_helpers import restore_import_state

from elasticdl.data.errors import BadRecord, BadRecordError, CorruptRecordError
from elasticdl.data.sources import Shard, read_records
from elasticdl.data.tfrecord import write_records
from elasticdl.errors import EXIT_USER_ERROR, TrainingDivergedError, exit_status
from elasticdl.master.evaluation_service import TaskDispatcher
from elasticdl.master.report import JobReport
from elasticdl.master.task_manager import TaskManager
from elasticdl.mode import Mode
from elasticdl.model.records import describe_error, example_check, find_bad_records
from elasticdl.model.spec import DatasetMetadata, load_model_spec
from elasticdl.model.trainer import Trainer
from elasticdl.rpc.master_client import TaskOrder
from elasticdl.rpc.ps_client import PullResult, PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker import worker as worker_module
from elasticdl.worker.worker import MAX_NONFINITE_BATCHES, Worker

ZOO = """\
import keras
import tensorflow as tf

_FEATURES = {"x": tf.io.FixedLenFeature([4], tf.float32), "y": tf.io.FixedLenFeature([1], tf.int64)}


def custom_model():
    inputs = keras.Input(shape=(4,), name="x")
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(inputs))


def loss(labels, predictions):
    labels = tf.reshape(labels, [-1])
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))


def optimizer(lr=0.1):
    return keras.optimizers.SGD(learning_rate=lr)


def eval_metrics_fn():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}


def dataset_fn(dataset, mode, metadata):
    if metadata.record_format == "csv":
        def parse_line(line):
            x0, x1, x2, x3, y = tf.io.decode_csv(line, [[0.0], [0.0], [0.0], [0.0], [0]])
            return tf.stack([x0, x1, x2, x3]), tf.reshape(tf.cast(y, tf.int64), [1])
        return dataset.map(parse_line)

    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        return example["x"], example["y"]
    return dataset.map(parse)
"""


def example(i: int, label: int | None = None, x=None) -> bytes:
    feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x or [i / 10, 1.0, -1.0, 0.5]))}
    if label != -1:
        feature["y"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3 if label is None else label]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_data(path, n: int = 12, missing_label=(), label_out_of_range=(), nan=()) -> str:
    def record(i):
        if i in missing_label:
            return example(i, label=-1)
        if i in label_out_of_range:
            return example(i, label=7)
        if i in nan:
            return example(i, x=[float("nan")] * 4)
        return example(i)

    write_records(path, (record(i) for i in range(n)))
    return str(path)


def corrupt_data_of_record(path, index: int) -> None:
    """Flip a byte in the data of record ``index`` (its header and framing stay intact)."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    offset = 0
    for _ in range(index):
        length = int.from_bytes(raw[offset:offset + 8], "little")
        offset += 12 + length + 4
    raw[offset + 12 + 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)


_restore_import_state = restore_import_state("badzoo")


@pytest.fixture
def spec(tmp_path):
    package = tmp_path / "zoo" / f"badzoo_{os.getpid()}_{id(tmp_path)}"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(ZOO)
    return load_model_spec(str(tmp_path / "zoo"), f"{package.name}.model.custom_model")


# ---------------------------------------------------------------- readers


def test_a_corrupt_tfrecord_record_is_skipped_with_on_corrupt_and_raises_without(tmp_path):
    path = write_data(tmp_path / "d.tfrecord", n=6)
    corrupt_data_of_record(path, 3)
    with pytest.raises(CorruptRecordError, match="record 3 .*data CRC mismatch"):
        list(read_records(path, 0, 6))
    seen = []
    records = list(read_records(path, 0, 6, on_corrupt=seen.append))
    assert [tf.train.Example.FromString(r).features.feature["x"].float_list.value[0] for r in records] == \
        pytest.approx([0.0, 0.1, 0.2, 0.4, 0.5])
    assert [(e.path, e.index) for e in seen] == [(path, 3)]


# ---------------------------------------------------------------- finding the records to blame


def test_find_bad_records_bisects_to_the_records_that_fail_on_their_own():
    records = [b"ok"] * 11 + [b"bad"] + [b"ok"] * 4 + [b"bad"]
    calls = []

    def check(group):
        calls.append(len(group))
        if b"bad" in group:
            raise ValueError("cannot parse 'bad'")

    assert find_bad_records(records, check) == [(11, "ValueError: cannot parse 'bad'"),
                                                (16, "ValueError: cannot parse 'bad'")]
    assert len(calls) < len(records)  # fewer checks than one per record


def test_find_bad_records_blames_no_record_when_none_fails_alone_or_the_cause_is_elsewhere():
    def only_in_pairs(group):
        if len(group) > 1:
            raise ValueError("batch-level problem")

    assert find_bad_records([b"a", b"b", b"c"], only_in_pairs) == []

    def unreachable(group):
        raise TrainingDivergedError("not the records' fault")

    with pytest.raises(TrainingDivergedError):  # a passthrough error ends the search
        find_bad_records([b"a", b"b"], unreachable, passthrough=(TrainingDivergedError,))


def test_describe_error_keeps_tensorflows_message_and_drops_its_decorations():
    err = tf.errors.InvalidArgumentError(None, None, (
        "{{function_node __wrapped__IteratorGetNext_output_types_2_device_/job:localhost/replica:0/task:0/"
        "device:CPU:0}} Feature: y (data type: int64) is required but could not be found.\n\t [[{{node "
        "ParseSingleExample/ParseExample/ParseExampleV2}}]] [Op:IteratorGetNext] name: "))
    assert describe_error(err) == \
        "InvalidArgumentError: Feature: y (data type: int64) is required but could not be found."
    in_a_pipeline = tf.errors.InvalidArgumentError(None, None, (
        "Error in user-defined function passed to MapDataset:202 transformation with iterator: "
        "Iterator::Root::Prefetch::BatchV2::Shuffle::ParallelMapV2: Feature: y (data type: int64) is required"))
    assert describe_error(in_a_pipeline) == "InvalidArgumentError: Feature: y (data type: int64) is required"


@pytest.mark.parametrize("kind, index, reason", [
    ("missing_label", 5, "Feature: y (data type: int64) is required but could not be found"),
    ("label_out_of_range", 9, "Received a label value of 7 which is outside the valid range of [0, 3)"),
])
def test_example_check_finds_unparseable_records_and_labels_the_loss_rejects(spec, tmp_path, kind, index, reason):
    path = write_data(tmp_path / "d.tfrecord", **{kind: {index}})
    records = list(read_records(path, 0, 12))
    trainer = Trainer(spec, {})
    check = example_check(spec, Mode.TRAINING, DatasetMetadata("tfrecord"), lambda f: trainer.model(f))
    found = find_bad_records(records, check)
    assert [i for i, _ in found] == [index]
    assert reason in found[0][1]


def test_example_check_finds_a_csv_line_with_the_wrong_column_count(spec):
    lines = [b"0.1,0.2,0.3,0.4,1"] * 5 + [b"0.1,0.2,0.3,1"] + [b"0.5,0.2,0.3,0.4,2"] * 2
    trainer = Trainer(spec, {})
    check = example_check(spec, Mode.TRAINING, DatasetMetadata("csv"), lambda f: trainer.model(f))
    found = find_bad_records(lines, check)
    assert [i for i, _ in found] == [5] and "Expect 5 fields but have 4" in found[0][1]


# ---------------------------------------------------------------- the worker


class FakePS:
    """One PS: holds the pushed model, applies nothing, counts pushes."""

    num_ps = 1

    def __init__(self):
        self.params: dict | None = None
        self.version = 0
        self.pushes = 0
        self.fail_pushes_with: Exception | None = None

    def pull(self, versions, wait_for_newer=None, timeout=30.0):
        return [PullResult(self.params is not None, self.version, dict(self.params or {}))]

    def push_model(self, params, version=0, non_trainable=()):
        if self.params is None:
            self.params = dict(params)
            return [True]
        return [False]

    def push_embedding_table_infos(self, infos):
        pass

    def pull_snapshot(self, snapshot_id):
        return self.pull([-1])

    def split(self, grads):
        return [grads]

    def push_gradients(self, grads_by_ps, versions, lr, worker_id, want_parameters=False, batch=None):
        if self.fail_pushes_with is not None:
            raise self.fail_pushes_with
        self.pushes += 1
        self.version += 1
        return {0: PushAnswer(PushOutcome.APPLIED, self.version)}


class FakeMaster:
    def __init__(self, orders):
        self.orders = list(orders)
        self.reports: list[dict] = []

    def get_task(self):
        return self.orders.pop(0) if self.orders else TaskOrder("end")

    def report(self, task_id, records, err_message="", loss_sum=0.0, batches=0, model_version=0,
               metric_states=None, interrupted=False, bad_records=(), diverged=False, handout=0):
        self.reports.append(dict(task_id=task_id, records=records, err=err_message, batches=batches,
                                 bad_records=list(bad_records), diverged=diverged, interrupted=interrupted))
        return True

    def report_progress(self, task_id, records_done, model_version=0):
        pass


def run_worker(spec, path, end: int = 12, max_bad_records: int = 0, ps: FakePS | None = None, kind="training",
               **kwargs):
    order = TaskOrder(kind, task_id=7, path=path, start=0, end=end, snapshot_id=1 if kind == "evaluation" else 0)
    master, ps = FakeMaster([order]), ps or FakePS()
    worker = Worker(0, spec, Trainer(spec, {}), master, ps, minibatch_size=4, max_bad_records=max_bad_records,
                    **kwargs)
    worker.run()
    assert len(master.reports) == 1
    return master.reports[0], ps, worker


def test_by_default_a_bad_record_fails_the_task_naming_the_file_the_index_and_the_reason(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord", missing_label={5})
    report, _, _ = run_worker(spec, path)
    assert report["err"].startswith("BadRecordError: bad record: ")
    assert f"{path}: record 5: InvalidArgumentError: Feature: y" in report["err"]
    assert "--max_bad_records" in report["err"]
    assert [(r.path, r.index) for r in report["bad_records"]] == [(path, 5)]
    assert not report["diverged"]


@pytest.mark.parametrize("kind, index", [("missing_label", 5), ("label_out_of_range", 9), ("corrupt", 2)])
def test_with_max_bad_records_the_worker_skips_the_record_and_trains_the_rest(spec, tmp_path, kind, index):
    path = write_data(tmp_path / "d.tfrecord", **({kind: {index}} if kind != "corrupt" else {}))
    if kind == "corrupt":
        corrupt_data_of_record(path, index)
    report, ps, _ = run_worker(spec, path, max_bad_records=1)
    assert report["err"] == ""
    assert report["records"] == 11  # every record but the bad one
    assert [(r.path, r.index) for r in report["bad_records"]] == [(path, index)]
    assert ps.pushes == 3  # 11 records in batches of 4


def test_evaluation_skips_bad_records_within_max_bad_records(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord", missing_label={6})
    report, _, _ = run_worker(spec, path, max_bad_records=1, kind="evaluation")
    assert report["err"] == "" and report["records"] == 11
    assert [(r.path, r.index) for r in report["bad_records"]] == [(path, 6)]


def test_prediction_never_skips_a_bad_record_whatever_max_bad_records_says(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord", missing_label={6})
    report, _, _ = run_worker(spec, path, max_bad_records=5, kind="prediction",
                              prediction_outputs=str(tmp_path / "out"))
    assert report["err"].startswith(f"BadRecordError: bad record: {path}: record 6: InvalidArgumentError")
    assert "`elasticdl predict` skips no record" in report["err"]
    assert not (tmp_path / "out").exists()  # no part written for the task


def test_more_bad_records_than_allowed_fail_the_task_with_all_of_them(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord", missing_label={1, 6})
    report, _, _ = run_worker(spec, path, max_bad_records=1)
    assert "2 bad records, more than --max_bad_records=1" in report["err"]
    assert [r.index for r in report["bad_records"]] == [1, 6]


def test_a_failure_no_record_is_to_blame_for_is_reported_as_before(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord")
    ps = FakePS()
    ps.fail_pushes_with = RuntimeError("the PS is broken")
    report, _, _ = run_worker(spec, path, max_bad_records=5, ps=ps)
    assert report["err"] == "RuntimeError: the PS is broken"
    assert report["bad_records"] == [] and not report["diverged"]


def test_nan_loss_is_never_pushed_and_fails_after_max_nonfinite_batches_in_a_row(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord", n=16, nan=set(range(16)))
    report, ps, worker = run_worker(spec, path, end=16)
    assert ps.pushes == 0
    assert report["diverged"]
    assert report["err"].startswith(f"TrainingDivergedError: task 7 ({path} records 0-15), batch "
                                    f"{MAX_NONFINITE_BATCHES - 1}: the loss is nan")
    assert "Lower the learning rate" in report["err"] and "inputs" in report["err"]


def test_one_nan_batch_is_skipped_and_training_goes_on(spec, tmp_path):
    path = write_data(tmp_path / "d.tfrecord", n=12, nan={5})
    report, ps, _ = run_worker(spec, path)
    assert report["err"] == "" and not report["diverged"]
    assert ps.pushes == 2 and report["batches"] == 2  # the batch holding record 5 was not pushed


def test_nonfinite_gradients_with_a_finite_loss_count_too(spec, tmp_path, monkeypatch):
    path = write_data(tmp_path / "d.tfrecord", n=16)
    original = Trainer.compute_gradients

    def infinite_gradients(self, features, labels):
        loss, grads = original(self, features, labels)
        self.last_step_finite = False
        return loss, grads

    monkeypatch.setattr(Trainer, "compute_gradients", infinite_gradients)
    report, ps, _ = run_worker(spec, path, end=16)
    assert report["diverged"] and "the gradients hold NaN or Inf" in report["err"] and ps.pushes == 0
    assert worker_module.MAX_NONFINITE_BATCHES == 3


def test_the_trainer_tells_a_step_with_nonfinite_gradients(spec):
    trainer = Trainer(spec, {})
    features = tf.constant([[0.1, 0.2, 0.3, 0.4]] * 2)
    trainer.ensure_built(features)
    trainer.compute_gradients(features, tf.constant([[1], [2]]))
    assert trainer.last_step_finite
    trainer.compute_gradients(tf.constant([[np.inf, 0.2, 0.3, 0.4]] * 2), tf.constant([[1], [2]]))
    assert not trainer.last_step_finite


# ---------------------------------------------------------------- the master's side


def test_the_dispatcher_counts_each_bad_record_once_and_keeps_divergence_reports():
    tasks = TaskManager([Shard("a.rec", 0, 10), Shard("a.rec", 10, 20)], num_epochs=2, shuffle=False)
    dispatcher = TaskDispatcher(tasks, None)
    first = dispatcher.get_task(0)
    bad = BadRecord("a.rec", 3, "InvalidArgumentError: no label")
    assert dispatcher.report(first.task_id, 0, "", 9, bad_records=[bad]).accepted
    late = dispatcher.report(first.task_id, 1, "", 9, bad_records=[bad, BadRecord("a.rec", 4, "x")])
    assert not late.accepted  # a refused report still tells what the data holds
    assert dispatcher.bad_records() == [bad, BadRecord("a.rec", 4, "x")]
    second = dispatcher.get_task(0)
    dispatcher.report(second.task_id, 0, "TrainingDivergedError: nan", 0, diverged=True)
    assert dispatcher.divergences() == ["worker 0: TrainingDivergedError: nan"]


def test_a_dropped_task_keeps_its_last_error():
    tasks = TaskManager([Shard("a.rec", 0, 10)], max_task_retries=1, shuffle=False)
    for _ in range(2):
        task = tasks.get_task(0)
        tasks.report(task.task_id, 0, "ValueError: boom")
    assert [(t.task_id, t.retries, t.last_error) for t in tasks.dropped_tasks()] == \
        [(task.task_id, 2, "worker 0 failed it: ValueError: boom")]


def test_a_resumed_ledger_tries_the_tasks_the_failed_run_dropped_again():
    tasks = TaskManager([Shard("a.rec", 0, 10), Shard("a.rec", 10, 20)], max_task_retries=0, shuffle=False)
    dropped = tasks.get_task(0)
    tasks.report(dropped.task_id, 0, "ValueError: boom")
    assert tasks.dropped_tasks() == [dropped]  # the controller fails that run
    resumed = TaskManager([Shard("a.rec", 0, 10), Shard("a.rec", 10, 20)], max_task_retries=0, shuffle=False)
    resumed.restore(tasks.snapshot())
    assert resumed.dropped_tasks() == []
    again = [resumed.get_task(0), resumed.get_task(0)]
    assert sorted((t.shard.start, t.retries) for t in again) == [(0, 0), (10, 0)]


def test_the_report_lists_each_bad_record_and_dropped_task():
    tasks = TaskManager([Shard("a.rec", 0, 10)], max_task_retries=0, shuffle=False)
    dispatcher = TaskDispatcher(tasks, None)
    task = dispatcher.get_task(0)
    dispatcher.report(task.task_id, 0, "ValueError: boom", 0, bad_records=[BadRecord("a.rec", 3, "no label")])
    report = JobReport("j")
    report.add_faults(dispatcher, max_bad_records=2)
    assert report.bad_records == [{"path": "a.rec", "index": 3, "reason": "no label"}]
    assert report.max_bad_records == 2
    assert report.dropped == [{"task_id": task.task_id, "type": "training", "path": "a.rec", "start": 0,
                               "end": 10, "epoch": 0, "tries": 1, "error": "worker 0 failed it: ValueError: boom"}]
    assert '"bad_records"' in report.to_json()


def test_bad_record_and_divergence_errors_are_user_errors_with_one_line():
    err = BadRecordError([BadRecord("a.rec", 3, "InvalidArgumentError: no label.")])
    code, message = exit_status(err)
    assert code == EXIT_USER_ERROR
    assert message == ("error: bad record: a.rec: record 3: InvalidArgumentError: no label. Fix or remove it, "
                       "or pass --max_bad_records N to skip up to N bad records (the report lists each one)")
    assert exit_status(TrainingDivergedError("nan"))[0] == EXIT_USER_ERROR
    many = BadRecordError([BadRecord("a.rec", i, "r") for i in range(8)], 2)
    assert str(many).startswith("8 bad records, more than --max_bad_records=2: a.rec: record 0: r;")
    assert "and 3 more" in str(many)


def test_bad_records_and_divergence_travel_with_the_task_report_over_grpc():
    from master_loop import master_servicer

    from elasticdl.master.clocks import WorkerClocks
    from elasticdl.master.progress import TrainingProgress
    from elasticdl.proto import elasticdl_pb2_grpc
    from elasticdl.rpc.channel import bind_local, make_server
    from elasticdl.rpc.master_client import MasterClient

    dispatcher = TaskDispatcher(TaskManager([Shard("f", 0, 10), Shard("f", 10, 20)], shuffle=False), None)
    server = make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(
        master_servicer(dispatcher, TrainingProgress(20, 1), WorkerClocks()), server
    )
    port = bind_local(server)
    server.start()
    client = MasterClient(f"127.0.0.1:{port}", worker_id=3)
    try:
        first = client.get_task()
        assert client.report(first.task_id, 9, "", 0.5, 1, 1, bad_records=[BadRecord("f", 4, "no label")])
        second = client.get_task()
        client.report(second.task_id, 0, "TrainingDivergedError: nan", diverged=True)
        assert dispatcher.bad_records() == [BadRecord("f", 4, "no label")]
        assert dispatcher.divergences() == ["worker 3: TrainingDivergedError: nan"]
    finally:
        client.close()
        server.stop(grace=None)
