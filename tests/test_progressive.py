"""Progressive validation (--window_records): each training batch scored before it is trained on,
merged per window of records, checked against a hand computation.

The worker side runs the real Worker on the fake PS and master of test_worker_overlap: the
scores it sends are those of the parameters its gradients were computed on, before the push,
and a batch computed again (a sync PS refused it as stale) is scored once. The master side
merges reports into windows; the windows' metrics equal the metrics computed by hand over the
records each window holds.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from elasticdl.master.progressive import ProgressiveWindows, progressive_windows, to_tensorboard
from elasticdl.model.spec import ModelSpecError
from elasticdl.rpc.master_client import TaskOrder
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.progressive import ProgressiveScore
from tests.test_worker_overlap import _Trainer, _Unavailable, _worker


def _squared_error(labels, predictions):
    return (np.asarray(labels, np.float64) - np.asarray(predictions, np.float64)) ** 2


def _metrics():
    return {"accuracy": keras.metrics.BinaryAccuracy(), "squared_error": _squared_error}


def _by_hand(labels: np.ndarray, predictions: np.ndarray) -> dict[str, float]:
    return {"accuracy": float(np.mean((predictions > 0.5) == (labels > 0.5))),
            "squared_error": float(np.mean((labels - predictions) ** 2))}


class _Identity:
    """A trainer whose model's predictions are its inputs."""

    def __init__(self):
        self.embeddings = type("Tables", (), {"error": None})()

    def model(self, features, training):
        assert training is False  # scored in inference mode (no dropout, no BatchNorm update)
        return features


_identity = _Identity()


def _task_states(labels, predictions, batch: int = 2) -> dict:
    score = ProgressiveScore(_metrics)
    for i in range(0, len(labels), batch):
        score.score(i, _identity, predictions[i:i + batch], labels[i:i + batch])
    return score.take()


def test_windows_of_whole_tasks_equal_the_metrics_computed_by_hand_over_their_records():
    rng = np.random.default_rng(7)
    sizes = [3, 3, 4, 5, 2]  # window_records 5: tasks {0, 1} (6 records), {2, 3} (9), {4} (2, partial)
    labels = [rng.integers(0, 2, n).astype(np.float32) for n in sizes]
    predictions = [rng.random(n).astype(np.float32) for n in sizes]
    sink = []
    windows = ProgressiveWindows(_metrics, 5, sink=sink.append)
    closed = [windows.add(n, _task_states(y, p), model_version=10 + i)
              for i, (n, y, p) in enumerate(zip(sizes, labels, predictions))]
    assert [w is not None for w in closed] == [False, True, False, True, False]
    report = windows.finish()
    assert [(w["index"], w["first_record"], w["records"], w["tasks"], w["model_version"]) for w in report] == [
        (0, 0, 6, 2, 11), (1, 6, 9, 2, 13), (2, 15, 2, 1, 14)]
    for window, tasks in zip(report, [(0, 1), (2, 3), (4,)]):
        expected = _by_hand(np.concatenate([labels[t] for t in tasks]), np.concatenate([predictions[t] for t in tasks]))
        assert window["metrics"] == pytest.approx(expected, abs=1e-6)
    assert [w.index for w in sink] == [0, 1, 2]  # each closed window went to the sink (TensorBoard)


def test_a_report_without_scores_or_with_another_models_is_not_counted(caplog):
    windows = ProgressiveWindows(_metrics, 4)
    assert windows.add(5, None) is None and windows.add(5, {}) is None  # not scored: not in a window
    with caplog.at_level(logging.WARNING):
        assert windows.add(5, {"loss/0": np.zeros(2)}) is None
    assert windows.ignored == 1 and "unknown metric states" in caplog.text
    assert windows.finish() == []


def test_window_records_without_eval_metrics_fn_is_an_error_naming_the_flag():
    spec = type("Spec", (), {"eval_metrics_fn": None, "module_path": "zoo/m.py"})()
    with pytest.raises(ModelSpecError, match="--window_records 100 .* drop --window_records"):
        progressive_windows(100, spec, "train")
    assert progressive_windows(0, spec, "train") is None


def test_tensorboard_gets_a_windows_metrics_at_the_records_scored_so_far():
    written = []
    board = type("Board", (), {"scalars": lambda self, step, values, prefix: written.append((step, values, prefix))})()
    windows = ProgressiveWindows(_metrics, 2, sink=lambda w: to_tensorboard(board, w))
    windows.add(3, _task_states(np.array([1, 0, 1], np.float32), np.array([0.9, 0.2, 0.4], np.float32)))
    assert written == [(3, pytest.approx({"accuracy": 2 / 3, "squared_error": (0.01 + 0.04 + 0.36) / 3}),
                        "progressive/")]


class _ScoringTrainer(_Trainer):
    """The fake trainer, with a model whose prediction is the PS version its parameters came from."""

    def __init__(self, log):
        super().__init__(log)
        self.scored_on = []
        self.unreachable = 0  # the next scores' row lookups find a PS away

    def model(self, features, training):
        if self.unreachable:
            self.unreachable -= 1
            self.embeddings.error = _Unavailable()  # what a row lookup records, under TensorFlow's error
            raise RuntimeError("UnknownError: Arguments received by Embedding.call()")
        version = None if self.params is None else int(self.params["w"][0])
        self.scored_on.append(version)
        self.log.append(f"score {len(self.scored_on)}")
        return np.full(len(features), float(version), np.float32)


def _scoring_worker(sync: bool):
    worker, ps, master, log = _worker(sync=sync)
    trainer = _ScoringTrainer(log)
    trainer.params = worker.trainer.params
    worker.trainer = trainer
    worker.progressive = ProgressiveScore(lambda: {"version": lambda labels, predictions: predictions})
    states = []
    master.report = lambda task_id, records, err="", loss=0.0, batches=0, version=0, metric_states=None, **kw: \
        states.append((records, metric_states))
    return worker, ps, master, log, states


def _feed(worker, order: TaskOrder, batches: int) -> None:
    def run_batches(order, mode, step):
        for i in range(batches):
            assert step((np.zeros(2, np.float32), np.zeros(2, np.float32)), 2 * (i + 1))
    worker._run_batches = run_batches
    worker.master.orders = [order]


def test_each_batch_is_scored_on_the_parameters_its_gradients_use_before_they_are_pushed():
    worker, ps, _, log, states = _scoring_worker(sync=False)
    worker.consistency.overlap = False
    _feed(worker, TaskOrder("training", 1, "f", 0, 6), batches=3)
    worker.run()
    assert [entry for entry in log if entry.split()[0] in ("score", "compute", "push")] == [
        "score 1", "compute 1", "push 1", "score 2", "compute 2", "push 2", "score 3", "compute 3", "push 3"]
    assert worker.trainer.scored_on == worker.trainer.computed_on  # the very parameters of the gradients
    (records, sent), = states
    assert records == 6
    # Each batch predicted the version it was scored on: the mean over the task's 6 records.
    assert sent["version/0"] == pytest.approx([2 * sum(worker.trainer.scored_on), 6])


def test_a_batch_computed_again_after_a_stale_refusal_is_scored_once():
    worker, ps, _, log, states = _scoring_worker(sync=True)
    ps.refusals = [PushOutcome.REJECTED_STALE]  # the first push is refused: the batch is pulled and computed again
    _feed(worker, TaskOrder("training", 1, "f", 0, 4), batches=2)
    worker.run()
    assert worker.trainer.computed == 3  # batch 1 twice, batch 2 once
    assert len(worker.trainer.scored_on) == 2
    (records, sent), = states
    assert sent["version/0"][1] == 4  # 4 records scored, each once


def test_a_score_whose_row_lookup_finds_a_ps_away_is_retried_and_counted_once():
    """The model's call wraps a failed row lookup in a TensorFlow error; scored as it was, the batch
    failed as if its records were bad (the acceptance run's job failed on 'bad records'). Now the
    lookup's own error is raised: the batch loop waits for the PS and scores the batch then, once."""
    worker, ps, _, log, states = _scoring_worker(sync=False)
    worker.consistency.overlap = False
    worker.trainer.unreachable = 1
    _feed(worker, TaskOrder("training", 1, "f", 0, 4), batches=2)
    worker.run()
    assert len(worker.trainer.scored_on) == 2 and worker.trainer.computed == 2
    (records, sent), = states
    assert sent["version/0"][1] == 4
