"""The task ledger's vocabulary: tasks, attempts, outcomes and per-epoch counts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from elasticdl.data.sources import Shard

# Evaluation task ids live above this (round r starts at r * EVAL_ID_BASE), so a report
# is routed to its round, or to the main ledger, by its id alone.
EVAL_ID_BASE = 1_000_000_000


class TaskType(enum.StrEnum):
    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"


class NoTask(enum.Enum):
    """What ``get_task`` returns when it has no task to give."""

    WAIT = "wait"  # others hold the remaining tasks; one may come back
    END = "end"  # the job is finished


@dataclass
class Task:
    task_id: int
    type: TaskType
    shard: Shard
    epoch: int
    retries: int = 0
    snapshot_id: int = 0  # evaluation: the PS snapshot to evaluate
    model_version: int = -1  # evaluation: the version that snapshot holds
    requeued: bool = False  # back in todo after its worker died (logged when handed out again)
    last_error: str = ""  # why its last try failed (a dropped task fails the job with it)
    origin: int = -1  # the task's first record (-1: shard.start); shard.start is where training resumes
    handout: int = 0  # training: the current hand-out's number (0: not handed out)

    def __post_init__(self) -> None:
        if self.origin < 0:
            self.origin = self.shard.start

    @property
    def records(self) -> int:
        return self.shard.records


@dataclass
class Doing:
    task: Task
    worker_id: int
    started: float
    progress: int = 0  # records of this attempt trained so far (the worker's progress reports)


@dataclass(frozen=True)
class ReportOutcome:
    accepted: bool
    reason: str = ""


@dataclass
class EpochStats:
    epoch: int
    records_total: int
    records_done: int = 0
    tasks_done: int = 0
    tasks_retried: int = 0
    tasks_interrupted: int = 0  # attempts that did not complete, whatever the cause (see requeues)
    # Records of attempts that did not complete (worker killed, failed, timed out) and are
    # trained again: the price of a hard failure. A graceful preemption adds nothing.
    records_trained_twice: int = 0
    dropped: list[Task] = field(default_factory=list)
    # Records trained again, by cause: "rollback" (the PS went back to a checkpoint),
    # "worker died", "task failed", "timeout". With the PS's marks only records whose
    # updates were lost are trained again; the rest of a taken-back task is not.
    retrained: dict[str, int] = field(default_factory=dict)

    requeues: dict[str, int] = field(default_factory=dict)  # cause -> attempts taken back

    def interrupted(self, cause: str) -> None:
        """An attempt did not complete (``cause``: "worker left", "worker died", "task failed",
        "timeout", "rollback", "master restart"); what is left of it goes back to todo."""
        self.tasks_interrupted += 1
        self.requeues[cause] = self.requeues.get(cause, 0) + 1

    def count_retrained(self, cause: str, records: int) -> None:
        if records > 0:
            self.retrained[cause] = self.retrained.get(cause, 0) + records
            self.records_trained_twice += records


@dataclass
class Fencing:
    """A task taken back from its worker, waiting for its hand-out to be fenced on the PS."""

    doing: Doing
    cause: str
    progress: int
    retry_why: str  # "": it goes back to the front of todo; else it is retried (counted) for this
    asked: bool = False
