"""The task dispatcher: what a worker gets next, and where its report goes.

Evaluation tasks first, then the main ledger (training or prediction). Pure and
single-threaded like the ledgers it stands before: only the job loop's thread calls it (the
workers' requests are served there, elasticdl/master/request_desk.py), except ``halt``, which
only sets a flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from elasticdl.data.errors import BadRecord
from elasticdl.data.sources import Shard, file_footer
from elasticdl.master.tasks import EVAL_ID_BASE, NoTask, ReportOutcome, Task

if TYPE_CHECKING:
    from elasticdl.master.evaluation_service import EvaluationService
    from elasticdl.master.task_manager import TaskManager


class TaskDispatcher:
    """What a worker gets next: evaluation tasks first, then the main queue (training or prediction).

    Workers get WAIT, not END, until the job loop calls ``finish()``: the final
    evaluation may still need them after the last training task.
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
        # Workers whose exit the master handled (``recover_worker_tasks``). A request one sent
        # before it died may still be waiting on the loop (parked, or queued behind its exit): it
        # gets END, never a task, which would sit in doing for a worker that no longer exists.
        # Process indices are never reused (elasticdl/master/instance_manager.py).
        self._gone: set[int] = set()
        # When each live worker last asked for anything (``heard``): a worker that holds no task
        # and went silent past --task_timeout is frozen (``silent_workers``); a task's own timeout
        # covers a worker that holds one.
        self._heard: dict[int, float] = {}

    def halt(self, reason: str) -> None:
        """Stop acting at once (any thread: a store thread saw the leadership go): the master lost
        its leadership. Workers wait; their reports are refused, so nothing more is recorded in a
        ledger another master may own. Requests held for a task answer WAIT at the loop's next turn."""
        self._halted = reason

    def finish(self) -> None:
        self._finished = True

    def reopen(self) -> None:
        """Training goes on after all (a PS was lost before the model was saved): workers get
        tasks again, not END."""
        self._finished = False

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

    def heard(self, worker_id: int, at: float) -> None:
        """Worker ``worker_id`` asked for something at ``at`` (the caller's clock)."""
        if worker_id not in self._gone:
            self._heard[worker_id] = at

    def silent_workers(self, now: float) -> list[int]:
        """The workers heard from once (a worker still starting is not counted: a pod may take
        minutes) that hold no task and asked for nothing within --task_timeout (the main
        ledger's; none without one). An idle worker asks every second or so (a parked get_task
        is answered within TASK_WAIT_SECONDS)."""
        if self.main is None:
            return []
        busy, limit = self.active_workers(), self.main.task_timeout
        return sorted(w for w, at in self._heard.items() if w not in busy and now - at > limit)

    def gone(self, worker_id: int) -> bool:
        """The master handled this worker's exit: nothing is handed to it any more."""
        return worker_id in self._gone

    def _task_now(self, worker_id: int) -> Task | NoTask:
        if self._halted:
            return NoTask.WAIT
        if self._finished or worker_id in self._gone:
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
        """``worker_id`` exited: its tasks go back, and it is handed nothing more (``gone``)."""
        self._gone.add(worker_id)
        self._heard.pop(worker_id, None)
        self._footers_given.pop(worker_id, None)
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
