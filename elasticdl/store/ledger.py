"""A serialisable snapshot of the master's task ledger, for the state store.

The task manager describes its state as a :class:`LedgerSnapshot`; a state store keeps the
latest one (in memory, or in etcd), and a master that restarts rebuilds its task manager
from it. Pure, frozen dataclasses: a snapshot handed to a store cannot change under it.

What a snapshot holds:

- ``tasks``: the todo and doing tasks of the current epoch and the dropped tasks of every
  epoch (for the report). Todo tasks are listed in queue order: the first todo task in
  ``tasks`` is the next one handed out. Done tasks are optional (list the current epoch's
  for an audit trail); their epoch's :class:`EpochRecord` counts them either way.
- ``epochs``: per-epoch record accounting, one per started epoch: records done, records
  trained more than once (an interrupted task's records that were trained again).
- ``seq``: a sequence number the master increments with every change. Stores refuse to
  write a snapshot whose ``seq`` is not above the stored one, so a late writer never
  replaces a newer ledger with an older one.

Example::

    snap = LedgerSnapshot(seq=1, epoch=0, num_epochs=2, next_task_id=1,
                          tasks=(TaskRecord(0, "data/a.tfrecord", 0, 512, epoch=0),),
                          epochs=(EpochRecord(0, records_total=512),))
    assert LedgerSnapshot.from_bytes(snap.to_bytes()) == snap

On the wire a snapshot is compact JSON (file paths listed once, a task as an array),
zlib-compressed: about 4 to 10 bytes per task.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elasticdl.errors import JobFailure

LEDGER_FORMAT = 1


class LedgerFormatError(JobFailure, ValueError):
    """Stored ledger bytes that are not a snapshot this version can read."""


class TaskState(enum.StrEnum):
    TODO = "todo"
    DOING = "doing"
    DONE = "done"
    DROPPED = "dropped"


@dataclass(frozen=True)
class TaskRecord:
    """One task: records ``start`` .. ``end - 1`` of ``path`` in ``epoch``."""

    task_id: int
    path: str
    start: int
    end: int
    epoch: int
    retries: int = 0
    state: TaskState = TaskState.TODO
    worker_id: int = -1  # who holds it when doing; -1 otherwise
    # The task's first record when ``start`` is where training resumes (part of it was applied
    # before it was taken back); -1: ``start``.
    origin: int = -1

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise LedgerFormatError(f"task {self.task_id}: invalid range {self.path}[{self.start}:{self.end}]")
        if not isinstance(self.state, TaskState):
            try:
                object.__setattr__(self, "state", TaskState(self.state))
            except ValueError:
                raise LedgerFormatError(
                    f"task {self.task_id}: unknown state {self.state!r}; "
                    f"expected one of {[s.value for s in TaskState]}"
                ) from None

    @property
    def records(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class EpochRecord:
    """Record accounting of one epoch."""

    epoch: int
    records_total: int
    records_done: int = 0
    records_duplicated: int = 0  # records trained more than once
    tasks_done: int = 0
    tasks_retried: int = 0
    retrained: dict = dataclasses.field(default_factory=dict)  # cause -> records trained again


@dataclass(frozen=True)
class LedgerSnapshot:
    seq: int
    epoch: int
    num_epochs: int
    next_task_id: int
    tasks: tuple[TaskRecord, ...] = ()
    epochs: tuple[EpochRecord, ...] = ()
    task_type: str = "training"
    # Whatever identifies the job's data and flags; a master resuming a ledger with another
    # fingerprint is resuming a different job and should refuse.
    job_fingerprint: str = ""
    # Opaque JSON the task manager needs to continue as it would have, e.g. the state of
    # its shuffling RNG (see encode_rng_state).
    shuffle_state: Any = None
    saved_at: float = 0.0  # wall-clock seconds, for humans

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "epochs", tuple(self.epochs))
        if self.seq < 0:
            raise LedgerFormatError(f"seq must be >= 0. Received: seq={self.seq}")
        ids = [t.task_id for t in self.tasks]
        if len(set(ids)) != len(ids):
            raise LedgerFormatError("task ids must be unique in a ledger snapshot")
        if ids and max(ids) >= self.next_task_id:
            raise LedgerFormatError(
                f"next_task_id must exceed every task id. Received: next_task_id={self.next_task_id}, "
                f"largest task id {max(ids)}"
            )

    # ------------------------------------------------------------ views

    def in_state(self, state: TaskState) -> list[TaskRecord]:
        """Tasks in ``state``, in ledger order (queue order for todo)."""
        return [t for t in self.tasks if t.state is state]

    @property
    def finished(self) -> bool:
        """Every epoch is started and no task is left to train."""
        return self.epoch + 1 >= self.num_epochs and not any(
            t.state in (TaskState.TODO, TaskState.DOING) for t in self.tasks
        )

    def requeue_in_flight(self) -> LedgerSnapshot:
        """What a restarted master resumes from: tasks in doing go back to the front of todo.

        Their workers may have trained part of them; the records are trained again (count
        them as duplicated when the task is done). Retry counts do not change: the master
        died, not the task. ``seq`` is unchanged; the caller saves the result with seq + 1.
        """
        doing = [
            dataclasses.replace(t, state=TaskState.TODO, worker_id=-1)
            for t in self.tasks
            if t.state is TaskState.DOING
        ]
        rest = [t for t in self.tasks if t.state is not TaskState.DOING]
        return dataclasses.replace(self, tasks=tuple(doing + rest))

    def next(self, **changes: Any) -> LedgerSnapshot:
        """A copy with ``seq + 1`` and ``changes``."""
        return dataclasses.replace(self, seq=self.seq + 1, **changes)

    # ------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        paths: dict[str, int] = {}
        tasks = []
        for t in self.tasks:
            index = paths.setdefault(t.path, len(paths))
            row = [t.task_id, index, t.start, t.end, t.epoch, t.retries, t.state.value, t.worker_id]
            tasks.append(row + [t.origin] if t.origin >= 0 and t.origin != t.start else row)
        return {
            "format": LEDGER_FORMAT,
            "seq": self.seq,
            "epoch": self.epoch,
            "num_epochs": self.num_epochs,
            "next_task_id": self.next_task_id,
            "task_type": self.task_type,
            "job_fingerprint": self.job_fingerprint,
            "saved_at": self.saved_at,
            "paths": list(paths),
            "tasks": tasks,
            "epochs": [dataclasses.asdict(e) for e in self.epochs],
            "shuffle_state": self.shuffle_state,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LedgerSnapshot:
        if not isinstance(d, dict):
            raise LedgerFormatError(f"a ledger snapshot is a JSON object. Received: {type(d).__name__}")
        fmt = d.get("format")
        if fmt != LEDGER_FORMAT:
            raise LedgerFormatError(
                f"ledger format {fmt!r} is not supported by this ElasticDL (it reads format {LEDGER_FORMAT})"
            )
        try:
            paths = d["paths"]
            tasks = tuple(
                TaskRecord(tid, paths[pi], start, end, epoch, retries, TaskState(state), worker, *origin)
                for tid, pi, start, end, epoch, retries, state, worker, *origin in d["tasks"]
            )
            epochs = tuple(EpochRecord(**e) for e in d["epochs"])
            return cls(
                seq=int(d["seq"]),
                epoch=int(d["epoch"]),
                num_epochs=int(d["num_epochs"]),
                next_task_id=int(d["next_task_id"]),
                tasks=tasks,
                epochs=epochs,
                task_type=d.get("task_type", "training"),
                job_fingerprint=d.get("job_fingerprint", ""),
                shuffle_state=d.get("shuffle_state"),
                saved_at=float(d.get("saved_at", 0.0)),
            )
        except LedgerFormatError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise LedgerFormatError(f"malformed ledger snapshot: {type(e).__name__}: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> LedgerSnapshot:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise LedgerFormatError(f"ledger snapshot is not JSON: {e}") from None
        return cls.from_dict(d)

    def to_bytes(self) -> bytes:
        """Compressed JSON, what the stores keep."""
        return zlib.compress(self.to_json().encode("utf-8"), 6)

    @classmethod
    def from_bytes(cls, data: bytes) -> LedgerSnapshot:
        try:
            text = zlib.decompress(data)
        except zlib.error as e:
            raise LedgerFormatError(f"ledger snapshot is not zlib data: {e}") from None
        return cls.from_json(text)


def encode_rng_state(state: tuple) -> list:
    """``random.Random.getstate()`` as JSON-able lists (for ``shuffle_state``)."""
    return [state[0], list(state[1]), state[2]]


def decode_rng_state(obj: Iterable) -> tuple:
    """The inverse of :func:`encode_rng_state`, for ``random.Random.setstate``."""
    version, internal, gauss = obj
    return (version, tuple(internal), gauss)
