"""Metric merging, evaluation rounds and the dispatcher, in process."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from elasticdl.callbacks import CallbackList, EarlyStopping, LearningRateScheduler
from elasticdl.data.sources import Shard
from elasticdl.master.evaluation_service import (
    EVAL_ID_BASE,
    EvaluationService,
    FrozenSnapshot,
    TaskDispatcher,
)
from elasticdl.master.task_manager import NoTask, Task, TaskManager, TaskType
from elasticdl.model.metrics import MetricsAccumulator, MetricsMerger
from elasticdl.model.prediction import join_parts, write_part


def binary_metrics():
    return {
        "accuracy": keras.metrics.BinaryAccuracy(),
        "auc": keras.metrics.AUC(num_thresholds=200),
        "mse": keras.metrics.MeanSquaredError(),
        "abs_error": lambda y, p: np.abs(np.asarray(y, np.float32) - np.asarray(p)).reshape(-1),
    }


def test_state_merge_equals_keras_evaluate_over_all_records():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 5)).astype(np.float32)
    y = (x @ rng.normal(size=5) + rng.normal(size=1000) > 0).astype(np.float32).reshape(-1, 1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, activation="sigmoid")])
    # Keras over everything at once.
    model.compile(loss="mse", metrics=[keras.metrics.BinaryAccuracy(), keras.metrics.AUC(num_thresholds=200)])
    _, accuracy, auc = model.evaluate(x, y, batch_size=1000, verbose=0)
    predictions = model(x).numpy()
    mse = float(np.mean((predictions - y) ** 2))
    # Ours: uneven "tasks", each with its own accumulator, merged by state on the "master".
    merger = MetricsMerger(binary_metrics)
    for start, end in [(0, 137), (137, 500), (500, 501), (501, 1000)]:
        acc = MetricsAccumulator(binary_metrics())
        for b in range(start, end, 64):
            stop = min(end, b + 64)
            acc.update(y[b:stop], model(x[b:stop]))
        merger.add(acc.states())
    merged = merger.result()
    assert merged["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert merged["auc"] == pytest.approx(auc, abs=1e-4)
    assert merged["mse"] == pytest.approx(mse, abs=1e-6)
    assert merged["abs_error"] == pytest.approx(float(np.mean(np.abs(y - predictions))), abs=1e-6)
    # An average of per-task AUCs would differ: the merge really is by state.
    assert merger.tasks == 4


def test_nested_metrics_per_output():
    metrics = lambda: {"a": {"mse": keras.metrics.MeanSquaredError()}, "b": {"mae": keras.metrics.MeanAbsoluteError()}}  # noqa: E731
    acc = MetricsAccumulator(metrics())
    labels = {"a": np.ones((4, 1)), "b": np.zeros((4, 1))}
    acc.update(labels, {"a": np.full((4, 1), 3.0), "b": np.full((4, 1), -2.0)})
    merger = MetricsMerger(metrics)
    merger.add(acc.states())
    assert merger.result() == {"a/mse": pytest.approx(4.0), "b/mae": pytest.approx(2.0)}


def make_service(shards):
    """A service and the snapshots taken for it: ``snap(service)`` plays the controller and the
    job, which take a round's snapshot before it starts."""
    taken, dropped = [], []
    service = EvaluationService(shards, binary_metrics, evaluation_steps=10, throttle_secs=0.0)
    return service, taken, dropped


def snap(service, taken, version) -> FrozenSnapshot:
    round_id = service.reserve_round()
    taken.append(round_id)
    return FrozenSnapshot(round_id, version)


def test_evaluation_round_counts_each_record_once_across_retries():
    shards = [Shard("v", 0, 50), Shard("v", 50, 100)]
    service, taken, dropped = make_service(shards)
    round_ = service.start("epoch 1", snap(service, taken, 7))
    assert taken == [round_.round_id] and round_.model_version == 7
    first = service.get_task(0)
    second = service.get_task(1)
    assert first.task_id >= EVAL_ID_BASE and first.snapshot_id == round_.round_id and first.model_version == 7
    state = MetricsAccumulator(binary_metrics())
    state.update(np.ones((50, 1)), np.ones((50, 1)))
    states = state.states()
    # Worker 1 fails its task: its (partial) state is never merged; the task is retried.
    assert service.report(second.task_id, 1, "boom", 0, states).accepted
    assert service.report(first.task_id, 0, "", 50, states).accepted
    assert not service.report(first.task_id, 0, "", 50, states).accepted  # duplicate: ignored
    retry = service.get_task(0)
    assert retry.task_id == second.task_id
    service.report(retry.task_id, 0, "", 50, states)
    result = service.poll()
    assert result.records == 100 and result.metrics["accuracy"] == 1.0
    assert dropped == [] and not service.busy  # the snapshot is the caller's to drop


def test_a_round_whose_snapshot_was_lost_runs_again_on_a_new_one():
    shards = [Shard("v", 0, 50), Shard("v", 50, 100)]
    service, taken, _ = make_service(shards)
    lost = service.start("epoch 1", snap(service, taken, 7))
    first = service.get_task(0)
    state = MetricsAccumulator(binary_metrics())
    state.update(np.ones((50, 1)), np.ones((50, 1)))
    assert service.report(first.task_id, 0, "", 50, state.states()).accepted
    in_flight = service.get_task(1)
    service.suspend()  # the PS holding the snapshot restarted
    assert service.get_task(2) is None and service.busy and service.poll() is None

    assert service.restart(snap(service, taken, 9)) == lost.round_id
    again = service.current
    assert again.round_id != lost.round_id and taken == [lost.round_id, again.round_id]
    assert again.reason == "epoch 1, again after a PS restart" and not again.suspended
    # The lost round's reports are refused: every record is evaluated on the new snapshot.
    assert not service.report(in_flight.task_id, 1, "", 50, state.states()).accepted
    tasks = [service.get_task(0), service.get_task(1)]
    assert all(t.snapshot_id == again.round_id for t in tasks)
    for worker_id, task in enumerate(tasks):
        assert service.report(task.task_id, worker_id, "", 50, state.states()).accepted
    assert service.poll().records == 100


def test_due_respects_steps_delay_and_busy():
    service, taken, _ = make_service([Shard("v", 0, 10)])
    assert not service.due(5) and service.due(10)
    service.start("every 10 versions", snap(service, taken, 10))
    assert not service.due(100)  # one round at a time


def test_dispatcher_gives_evaluation_first_and_waits_until_finished():
    training = TaskManager([Shard("t", 0, 10)], num_epochs=1)
    service, taken, _ = make_service([Shard("v", 0, 10)])
    dispatcher = TaskDispatcher(training, service)
    service.start("epoch 1", snap(service, taken, 3))
    assert dispatcher.get_task(0).type is TaskType.EVALUATION
    train_task = dispatcher.get_task(1)
    assert isinstance(train_task, Task) and train_task.type is TaskType.TRAINING
    assert dispatcher.get_task(2) is NoTask.WAIT
    dispatcher.report(train_task.task_id, 1, "", 10)
    assert dispatcher.main_finished
    assert dispatcher.get_task(1) is NoTask.WAIT  # not END: the final evaluation may need it
    dispatcher.finish()
    assert dispatcher.get_task(1) is NoTask.END
    assert not dispatcher.report(123, 0, "", 1).accepted


def test_prediction_parts_join_in_input_order(tmp_path):
    shards = [Shard("b.tfrecord", 0, 2), Shard("b.tfrecord", 2, 3), Shard("a.tfrecord", 0, 2)]
    # Written out of order, one of them twice (a retried task overwrites its part).
    write_part(str(tmp_path), "a.tfrecord", 0, [np.array([[5.0], [6.0]])])
    write_part(str(tmp_path), "b.tfrecord", 2, [np.array([[9.0]])])
    write_part(str(tmp_path), "b.tfrecord", 2, [np.array([[3.0]])])
    write_part(str(tmp_path), "b.tfrecord", 0, [np.array([[1.0], [2.0]])])
    out = join_parts(str(tmp_path), shards)
    assert np.loadtxt(out, delimiter=",", skiprows=1).tolist() == [1.0, 2.0, 3.0, 5.0, 6.0]


def test_prediction_join_reports_missing_parts(tmp_path):
    with pytest.raises(FileNotFoundError, match="1 prediction tasks wrote no output"):
        join_parts(str(tmp_path), [Shard("x", 0, 3)])


class FakeJob:
    def __init__(self):
        self.model_version = 0
        self.stopped = ""
        self.learning_rates = []

    def stop_training(self, reason):
        self.stopped = reason

    def set_learning_rate(self, lr):
        self.learning_rates.append(lr)

    def export(self, path):
        return path


def test_early_stopping_and_learning_rate_scheduler_act_on_the_job():
    job = FakeJob()
    stopper = EarlyStopping(monitor="accuracy", patience=1)
    scheduler = LearningRateScheduler(lambda step: 0.1 / (1 + step // 10), by="version")
    callbacks = CallbackList([stopper, scheduler], job=job)
    callbacks.on_train_begin()
    for version in (5, 10, 12, 20):
        callbacks.on_model_version(version)
    assert job.learning_rates == [0.1, 0.05, 0.1 / 3]
    for epoch, accuracy in enumerate([0.8, 0.9, 0.85, 0.88]):
        callbacks.on_epoch_end(epoch, {"accuracy": accuracy})
    # As Keras's: patience 1 stops at the first epoch that did not improve (0.85), once.
    assert job.stopped == "EarlyStopping: accuracy has not improved for 1 epoch (best 0.9000)"
    with pytest.raises(ValueError, match="`mode` must be"):
        EarlyStopping(mode="up")


def test_a_halted_dispatcher_hands_out_nothing_and_refuses_reports():
    main = TaskManager([Shard("f", 0, 10), Shard("f", 10, 20)], shuffle=False)
    dispatcher = TaskDispatcher(main, None)
    task = dispatcher.get_task(0)
    dispatcher.halt("lost the leader lock")
    assert dispatcher.get_task(1) is NoTask.WAIT
    outcome = dispatcher.report(task.task_id, 0, "", 10)
    assert not outcome.accepted and "lost the leader lock" in outcome.reason
    assert main.counts() == (1, 1)  # the ledger did not move
