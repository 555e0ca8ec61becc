"""Evaluation rounds: when to evaluate, the tasks of a round, and its merged metrics.

A round freezes the parameters on the PS (a snapshot tagged with the model version),
cuts the validation data into evaluation tasks that workers run with those parameters,
and merges the metric states of the accepted task reports, so each validation record
counts exactly once. One round runs at a time; training goes on meanwhile.

In a job only the job loop's thread calls it: the workers' reports are served there too
(elasticdl/master/request_desk.py), so a round is never published before its last report is
merged. The lock that covers a report (its checks, the ledger and the merge) and the round's
publication stays for callers with threads of their own (tests); uncontended, it costs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticdl.data.sources import Shard

# The dispatcher lived here; its callers still import it from here (elasticdl/master/dispatcher.py).
from elasticdl.master.dispatcher import TaskDispatcher
from elasticdl.master.task_manager import ReportOutcome, Task, TaskManager, TaskType
from elasticdl.master.tasks import EVAL_ID_BASE
from elasticdl.model.metrics import MetricsMerger

__all__ = ["EVAL_ID_BASE", "EvaluationResult", "EvaluationRound", "EvaluationService", "FrozenSnapshot",
           "TaskDispatcher"]

logger = logging.getLogger(__name__)

_AGAIN = ", again after a PS restart"


@dataclass
class EvaluationRound:
    round_id: int
    model_version: int
    reason: str  # "every N versions", "epoch 3", "final", "evaluate"
    tasks: TaskManager
    merger: MetricsMerger
    records: int = 0
    started: float = field(default_factory=time.monotonic)
    # A PS restarted and lost this round's snapshot: no more tasks until ``restart()``.
    suspended: bool = False


@dataclass(frozen=True)
class FrozenSnapshot:
    """A snapshot taken for a round that starts later (an epoch ended while a round ran)."""

    round_id: int
    model_version: int


@dataclass(frozen=True)
class EvaluationResult:
    round_id: int
    model_version: int
    reason: str
    metrics: dict[str, float]
    records: int
    seconds: float


class EvaluationService:
    def __init__(
        self,
        shards: Sequence[Shard],
        metrics_fn: Callable[[], dict[str, Any]],
        evaluation_steps: int = 0,
        start_delay_secs: float = 0.0,
        throttle_secs: float = 0.0,
        max_task_retries: int = 3,
        task_timeout: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._shards = list(shards)
        self._metrics_fn = metrics_fn
        self.evaluation_steps = evaluation_steps
        self._clock = clock
        self._not_before = clock() + start_delay_secs
        self._throttle = throttle_secs
        self._max_task_retries = max_task_retries
        self._task_timeout = task_timeout
        self._next_round = 1
        self._last_version = 0
        self._last_start = float("-inf")
        self.current: EvaluationRound | None = None
        self.results: list[EvaluationResult] = []
        self._dropped: list[Task] = []  # of finished rounds
        self._lock = threading.RLock()

    @property
    def busy(self) -> bool:
        return self.current is not None

    def due(self, model_version: int) -> bool:
        """--evaluation_steps: every N versions, after the delay, at most once per throttle."""
        now = self._clock()
        return bool(
            self.evaluation_steps
            and not self.busy
            and model_version >= self._last_version + self.evaluation_steps
            and now >= self._not_before
            and now - self._last_start >= self._throttle
        )

    def reserve_round(self) -> int:
        """A new round's id, which is also the id of its snapshot on the PS. The service takes no
        snapshot itself: the controller decides ``TakeSnapshot(round_id)``, and starts the round
        on the answer (an epoch's end may take its snapshot now and start its round later)."""
        round_id = self._next_round
        self._next_round += 1
        return round_id

    def start(self, reason: str, frozen: FrozenSnapshot) -> EvaluationRound:
        """Start a round on the snapshot ``frozen`` (called by the job loop alone)."""
        if self.current is not None:
            raise RuntimeError("an evaluation round is already running")
        with self._lock:
            return self._begin(frozen.round_id, frozen.model_version, reason)

    def _begin(self, round_id: int, version: int, reason: str) -> EvaluationRound:
        tasks = TaskManager(
            self._shards,
            num_epochs=1,
            task_timeout=self._task_timeout,
            max_task_retries=self._max_task_retries,
            task_type=TaskType.EVALUATION,
            shuffle=False,
            clock=self._clock,
            first_task_id=round_id * EVAL_ID_BASE,
        )
        self.current = EvaluationRound(round_id, version, reason, tasks, MetricsMerger(self._metrics_fn))
        self._last_version = version
        self._last_start = self._clock()
        logger.info("evaluating model version %d (%s)", version, reason)
        return self.current

    def suspend(self) -> None:
        """A PS went down: the running round's snapshot is gone there; hand out no more of its tasks."""
        with self._lock:
            if self.current is not None:
                self.current.suspended = True

    def restart(self, frozen: FrozenSnapshot) -> int:
        """Run the suspended round again on the fresh snapshot ``frozen``; returns the lost
        round's id. The new round has a new id (and snapshot id), so late reports of the lost
        round's tasks are refused."""
        lost = self.current
        if lost is None:
            raise RuntimeError("no evaluation round to restart")
        with self._lock:
            self.current = None
            self._begin(frozen.round_id, frozen.model_version, lost.reason if lost.reason.endswith(_AGAIN) else lost.reason + _AGAIN)
        return lost.round_id

    def get_task(self, worker_id: int) -> Task | None:
        """An evaluation task, or None when there is none to give now."""
        with self._lock:
            current = self.current
            if current is None or current.suspended:
                return None
            task = current.tasks.get_task(worker_id)
            if not isinstance(task, Task):
                return None
            task.snapshot_id, task.model_version = current.round_id, current.model_version
            return task

    def read_ahead(self, worker_id: int, task_id: int) -> Shard | None:
        """The records of the evaluation task ``worker_id`` gets after ``task_id`` in its round."""
        with self._lock:
            current = self.current
            if current is None or task_id // EVAL_ID_BASE != current.round_id:
                return None
            return current.tasks.read_ahead(worker_id)

    def report(
        self, task_id: int, worker_id: int, err_message: str, records: int, states, interrupted: bool = False
    ) -> ReportOutcome:
        """Metric states are checked (names, shapes, finite) before the task counts as done:
        a report whose states do not fit is refused and changes nothing."""
        with self._lock:
            current = self.current
            if current is None or task_id // EVAL_ID_BASE != current.round_id:
                return ReportOutcome(False, f"evaluation task {task_id} is not part of the running round")
            if interrupted:  # a partial evaluation is worth nothing: the whole task goes back
                return current.tasks.report(task_id, worker_id, "", 0, interrupted=True)
            if not err_message:
                problem = current.merger.problem(states)
                if problem:
                    reason = f"evaluation task {task_id}: {problem}"
                    logger.warning("ignored report from worker %d: %s", worker_id, reason)
                    return ReportOutcome(False, reason)
            outcome = current.tasks.report(task_id, worker_id, err_message, records)
            if outcome.accepted and not err_message:
                current.merger.add(states)  # only accepted reports: each record counts once
                current.records += records
            return outcome

    def poll(self) -> EvaluationResult | None:
        """The result of the running round once all its tasks are done.

        The snapshot stays on the PS: the caller drops it (``round_id``) after using it,
        e.g. to give callbacks the parameters that were evaluated.
        """
        with self._lock:
            current = self.current
            if current is None or not current.tasks.finished:
                return None
            self.current = None
        dropped = current.tasks.dropped_tasks()
        self._dropped += dropped
        if dropped:
            logger.error("evaluation of version %d skipped %d tasks that kept failing", current.model_version, len(dropped))
        result = EvaluationResult(
            current.round_id,
            current.model_version,
            current.reason,
            current.merger.result() if current.merger.tasks else {},
            current.records,
            round(time.monotonic() - current.started, 3),
        )
        self.results.append(result)
        logger.info(
            "evaluation of version %d (%s, %d records): %s",
            result.model_version, result.reason, result.records,
            ", ".join(f"{k}={v:.4f}" for k, v in result.metrics.items()) or "no metrics",
        )
        return result

    def recover_worker_tasks(self, worker_id: int) -> None:
        with self._lock:
            if self.current is not None:
                self.current.tasks.recover_worker_tasks(worker_id)

    def requeue_timed_out(self) -> list[int]:
        """Take back the running round's tasks held too long; the workers that held them."""
        with self._lock:
            if self.current is None:
                return []
            self.current.tasks.requeue_timed_out()
            return self.current.tasks.take_stalled()

    def dropped_tasks(self) -> list[Task]:
        """Evaluation tasks that failed past --max_task_retries, in every round so far."""
        with self._lock:
            return self._dropped + (self.current.tasks.dropped_tasks() if self.current is not None else [])

    def active_workers(self) -> set[int]:
        with self._lock:
            return self.current.tasks.active_workers() if self.current is not None else set()
