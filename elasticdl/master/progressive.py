"""Progressive validation on the master: the workers' batch scores merged per window of records.

Workers score each training batch before its gradients are pushed (elasticdl/worker/progressive.py)
and send the metric states of a task with its report. ``ProgressiveWindows`` sums the states of
accepted training reports, in the order the job loop takes them, into windows of
``--window_records`` records. A window closes at the first report that brings it to that many
records (a task is never split: its records carry one sum of states), so a window holds whole
tasks, and its ``records`` says how many. Each closed window is logged, written to TensorBoard
(``progressive/<metric>``, at the step of the records scored so far) and listed in report.json's
``progressive``; the last, partial one is closed when the job ends.

A task trained again after a rollback or a worker's death is scored again: progressive
validation counts what the workers saw, as the loss does, not the ledger's exactly-once records.
Pure but for the sink it is given: the job loop calls it, the tests feed it states.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from elasticdl.model.metrics import MetricsMerger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Window:
    """One closed window: records ``first_record`` .. ``first_record + records - 1`` of those scored."""

    index: int
    first_record: int
    records: int
    tasks: int
    model_version: int  # the newest version its reports named
    metrics: dict[str, float]


class ProgressiveWindows:
    """``add`` each accepted training report's states; ``finish`` at the end; ``windows`` closed."""

    def __init__(self, metrics_fn: Callable[[], dict[str, Any]], window_records: int,
                 sink: Callable[[Window], None] | None = None):
        if window_records < 1:
            raise ValueError(f"window_records must be at least 1, got {window_records}")
        self._metrics_fn = metrics_fn
        self.window_records = window_records
        self._sink = sink
        self.windows: list[Window] = []
        self.ignored = 0  # reports whose states were not these metrics' (logged)
        self._open()
        self._first = 0

    def _open(self) -> None:
        self._merger = MetricsMerger(self._metrics_fn)
        self._records = 0
        self._version = 0

    def add(self, records: int, states: dict | None, model_version: int = 0) -> Window | None:
        """One task's records and scores; the window it closed (None: still open, or no states)."""
        if not states or records <= 0:
            return None
        try:
            self._merger.add(states)
        except ValueError as err:  # a worker of another model, or a bug: never spoil the window
            self.ignored += 1
            logger.warning("progressive validation ignored a task report's scores: %s", err)
            return None
        self._records += records
        self._version = max(self._version, model_version)
        return self._close() if self._records >= self.window_records else None

    def finish(self) -> list[dict]:
        """Close the last, partial window; every window as the report lists them."""
        if self._merger.tasks:
            self._close()
        return [asdict(w) for w in self.windows]

    def _close(self) -> Window:
        window = Window(len(self.windows), self._first, self._records, self._merger.tasks, self._version,
                        self._merger.result())
        self.windows.append(window)
        self._first += self._records
        self._open()
        shown = ", ".join(f"{k}={v:.4g}" for k, v in window.metrics.items())
        logger.info("progressive validation, window %d (records %d-%d, model version %d): %s", window.index,
                    window.first_record, window.first_record + window.records - 1, window.model_version, shown)
        if self._sink is not None:
            self._sink(window)
        return window


def progressive_windows(window_records: int, spec, command: str,
                        sink: Callable[[Window], None] | None = None) -> ProgressiveWindows | None:
    """The job's windows (--window_records), or None when off. A model zoo without
    eval_metrics_fn cannot score: an error naming the flag."""
    if command != "train" or not window_records:
        return None
    if spec.eval_metrics_fn is None:
        from elasticdl.model.spec import ModelSpecError

        raise ModelSpecError(
            f"{spec.module_path}: --window_records {window_records} scores each batch with eval_metrics_fn(), "
            "which it does not define: define eval_metrics_fn() -> {name: metric}, or drop --window_records"
        )
    return ProgressiveWindows(spec.eval_metrics_fn, window_records, sink)


def to_tensorboard(tensorboard, window: Window) -> None:
    """A closed window's metrics as TensorBoard scalars, at the step of the records scored so far."""
    if tensorboard is not None:
        tensorboard.scalars(window.first_record + window.records, window.metrics, prefix="progressive/")
