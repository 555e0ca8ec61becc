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

from elasticdl.data.errors import BadRecord
from elasticdl.data.sources import Shard, file_footer
from elasticdl.master.task_manager import NoTask, ReportOutcome, Task, TaskManager, TaskType
from elasticdl.model.metrics import MetricsMerger

logger = logging.getLogger(__name__)

# Evaluation task ids live above this (round r starts at r * EVAL_ID_BASE), so a report
# is routed to its round by its id alone.
EVAL_ID_BASE = 1_000_000_000
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


class TaskDispatcher:
    """What a worker gets next: evaluation tasks first, then the main queue (training or prediction).

    Workers get WAIT, not END, until the job loop calls ``finish()``: the final
    evaluation may still need them after the last training task.

    Single-threaded: only the job loop's thread calls it (the workers' requests reach it through
    ``elasticdl.master.request_desk``), except ``halt``, which only sets a flag.
    """

    def __init__(self, main: TaskManager | None, evaluation: EvaluationService | None):
        self.main = main
        self.evaluation = evaluation
        self._finished = False
        self._halted = ""
        # What workers found, whichever task: bad records once each (by file and index, so a
        # record met again in a later epoch or retry counts once), and divergence errors.
        self._bad_records: dict[tuple[str, int], BadRecord] = {}
        self._diverged: list[str] = []
        # The files whose footer each worker was handed (``footers_for``); forgotten when it exits.
        self._footers_given: dict[int, set[str]] = {}

    def halt(self, reason: str) -> None:
        """Stop acting at once (any thread: a store thread saw the leadership go): the master lost
        its leadership. Workers wait; their reports are refused, so nothing more is recorded in a
        ledger another master may own. Requests held for a task answer WAIT at the loop's next turn."""
        self._halted = reason

    def finish(self) -> None:
        self._finished = True

    @property
    def finished(self) -> bool:
        """The job loop said so: workers get END."""
        return self._finished

    @property
    def halted(self) -> str:
        """Why this master stopped acting ('' while it acts)."""
        return self._halted

    def get_task(self, worker_id: int) -> Task | NoTask:
        """A task for ``worker_id`` now, or WAIT or END. Waiting for one is the job loop's
        (``RequestDesk`` parks the request and tries again after each change of a ledger)."""
        return self._task_now(worker_id)

    def read_ahead(self, worker_id: int, task: Task) -> Shard | None:
        """The records of the task ``worker_id`` gets after ``task`` from the same ledger, to read ahead."""
        if task.task_id >= EVAL_ID_BASE:
            return None if self.evaluation is None else self.evaluation.read_ahead(worker_id, task.task_id)
        return None if self.main is None else self.main.read_ahead(worker_id)

    def footers_for(self, worker_id: int, paths: Sequence[str]) -> list[tuple[str, int, bytes]]:
        """(path, size, footer) of the Parquet files among ``paths`` whose footer ``worker_id``
        was not handed yet and this process keeps (it read them to cut the tasks)."""
        found = []
        given = self._footers_given.setdefault(worker_id, set())
        for path in dict.fromkeys(paths):
            if path in given:
                continue
            footer = file_footer(path)
            if footer is not None:
                given.add(path)
                found.append((path, *footer))
        return found

    def _task_now(self, worker_id: int) -> Task | NoTask:
        if self._halted:
            return NoTask.WAIT
        if self._finished:
            return NoTask.END
        if self.evaluation is not None:
            task = self.evaluation.get_task(worker_id)
            if task is not None:
                return task
        if self.main is not None:
            task = self.main.get_task(worker_id)
            if isinstance(task, Task):
                return task
        return NoTask.WAIT

    def report(
        self, task_id: int, worker_id: int, err_message: str, records: int, states=None, interrupted: bool = False,
        bad_records: Sequence[BadRecord] = (), diverged: bool = False, handout: int = 0,
    ) -> ReportOutcome:
        """A worker's task report. ``bad_records`` and ``diverged`` are noted even when the report
        itself is refused (a late one): they are facts about the data and the model, and the
        controller decides on them (elasticdl/master/controller.py)."""
        if self._halted:
            return ReportOutcome(False, f"this master stopped acting: {self._halted}")
        for record in bad_records:
            self._bad_records.setdefault((record.path, record.index), record)
        if diverged:
            self._diverged.append(f"worker {worker_id}: {err_message}")
        if task_id >= EVAL_ID_BASE:
            if self.evaluation is None:
                return ReportOutcome(False, f"unknown task {task_id}")
            return self.evaluation.report(task_id, worker_id, err_message, records, states or {}, interrupted)
        if self.main is None:
            return ReportOutcome(False, f"unknown task {task_id}")
        return self.main.report(task_id, worker_id, err_message, records, interrupted, handout)

    def progress(self, task_id: int, worker_id: int, records_done: int) -> ReportOutcome:
        """Progress of a main-queue task (evaluation tasks send none); refused when not held."""
        if self._halted:
            return ReportOutcome(False, f"this master stopped acting: {self._halted}")
        if task_id >= EVAL_ID_BASE or self.main is None:
            return ReportOutcome(False, f"task {task_id} reports no progress here")
        return self.main.progress(task_id, worker_id, records_done)

    def recover_worker_tasks(self, worker_id: int) -> None:
        self._footers_given.pop(worker_id, None)  # a process started under its id has none
        if self.main is not None:
            self.main.recover_worker_tasks(worker_id)
        if self.evaluation is not None:
            self.evaluation.recover_worker_tasks(worker_id)

    def stalled_workers(self) -> list[int]:
        """Take back every task held past --task_timeout; the workers that held one (each is
        frozen, or too slow for the deadline: the controller replaces it)."""
        stalled = set()
        if self.main is not None:
            self.main.requeue_timed_out()
            stalled.update(self.main.take_stalled())
        if self.evaluation is not None:
            stalled.update(self.evaluation.requeue_timed_out())
        return sorted(stalled)

    def active_workers(self) -> set[int]:
        active = self.main.active_workers() if self.main is not None else set()
        if self.evaluation is not None:
            active |= self.evaluation.active_workers()
        return active

    @property
    def main_finished(self) -> bool:
        return self.main is None or self.main.finished

    def bad_records(self) -> list[BadRecord]:
        """Every bad record workers found in this job, each once, in the order found."""
        return list(self._bad_records.values())

    @property
    def bad_record_count(self) -> int:
        return len(self._bad_records)

    def divergences(self) -> list[str]:
        """The reports of workers whose loss or gradients stayed NaN/Inf."""
        return list(self._diverged)

    def dropped_tasks(self) -> list[Task]:
        """Tasks that failed past --max_task_retries: main ledger first, then evaluation rounds."""
        dropped = self.main.dropped_tasks() if self.main is not None else []
        return dropped + (self.evaluation.dropped_tasks() if self.evaluation is not None else [])
