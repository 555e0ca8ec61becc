"""The task ledger of a stream: tasks added as records arrive, no epochs, open until closed.

A stream job's ledger is the file ledger (elasticdl/master/task_manager.py) with three
differences:

- it starts empty, and ``add`` appends the tasks the stream source cut from new records
  (a task is a range of offsets of one partition: ``kafka://brokers/topic#partition``);
- while the stream is open, a worker with nothing to do is told to WAIT, not END, and the job
  is neither finished nor between epochs (no epoch end, no final checkpoint while it idles);
- ``close_stream`` (the idle timeout, a stop) ends it: the tasks cut so far still run, and the
  job ends when they are done.

Everything else (hand-outs, fencing, rewinds to a checkpoint's marks, timeouts, saving to and
resuming from the state store) is the file ledger's, with offsets for record indices. The
ledger holds every task cut, so ``offsets`` (each partition's end of what was cut) is where a
resumed master goes on cutting: the ledger, not the broker, holds the committed offsets.

Bounded over a long stream: ``compact`` folds each partition's done prefix into one done task
of its own, with a negative id (no worker, no PS mark ever names one), once a checkpoint cut
holds those records (``marks``: the cut's data position; None without --checkpoint_dir, where
no rollback is exact anyway). The ledger then holds, per partition, one compacted task plus
the tasks cut since the cut: its snapshot in the state store stays small for a job that runs
for days, and a resumed master finds the compacted offsets in it as in any done task. A
rollback goes back to the newest cut, which holds every compacted record: they stay done.
(Should that cut turn out damaged, the rollback to an older one counts the records it lacks
in ``records_possibly_missing``, as for a file job's older epochs.)

Stored before handed out (``hold_until_stored``, the job's ledger): a task the ledger cut is
handed out only once the state store holds a snapshot with it (``stored``, the seq the store
holds). A file job's tasks are fixed from the start; a stream's are cut as records arrive, so a
master whose ledger writes fail (the store cut off) could otherwise hand out tasks that its
successor, resuming the older stored ledger, cuts again from the same offsets under other ids:
the PS's marks (by task id) would not know them, and their records would be trained twice.
Held, they are in no worker's hands until they are in the store; a successor that never saw
them cuts their offsets again, and only once.

Pure Python, like the file ledger: no clock, no thread, no call out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from elasticdl.data.sources import Shard
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.tasks import NoTask, ReportOutcome, Task, TaskType
from elasticdl.store.ledger import LedgerSnapshot, TaskRecord, TaskState

logger = logging.getLogger(__name__)


class StreamTaskManager(TaskManager):
    """A training ledger fed by a stream source. ``add`` tasks, ``close_stream`` to end."""

    _open_ended = True

    def __init__(self, hold_until_stored: bool = False, **kwargs):
        super().__init__([], num_epochs=1, task_type=TaskType.TRAINING, shuffle=False, **kwargs)
        self.stream_open = True
        self.close_reason = ""
        self.gone = ""  # the topic was deleted (``topic_deleted``): why
        # New tasks wait here until the state store holds them (see the module's docstring):
        # (the ledger seq from which a snapshot holds the task, the task), in the order cut.
        self.hold_until_stored = hold_until_stored
        self._held: list[tuple[int, Task]] = []

    # ------------------------------------------------------------ the source

    def add(self, shards: Sequence[Shard]) -> int:
        """Append a task for each shard (records that arrived); how many were added (none once
        the stream is closed or training stopped)."""
        if not self.stream_open or self._stopped or not shards:
            return 0
        stats = self.epochs[self.epoch]
        tasks = []
        for shard in shards:
            tasks.append(Task(self._next_id, TaskType.TRAINING, shard, self.epoch))
            self._next_id += 1
            stats.records_total += shard.records
        self._todo.extend(tasks)
        self._bump()
        self._hold(tasks)
        return len(shards)

    # ------------------------------------------------------------ stored before handed out

    def stored(self, seq: int) -> int:
        """The state store holds the ledger as of ``seq``: the held tasks it holds may be handed
        out now. How many were released."""
        ready = [task for since, task in self._held if since <= seq]
        if not ready:
            return 0
        self._held = [(since, task) for since, task in self._held if since > seq]
        self._todo.extend(ready)
        self._bump()  # a request parked for a task looks again
        return len(ready)

    @property
    def held(self) -> int:
        """Tasks cut and not handed out yet because the state store does not hold them."""
        return len(self._held)

    def _hold(self, tasks: Sequence[Task]) -> None:
        """Take new ``tasks`` out of todo until a snapshot of ``self.seq`` or later is stored."""
        if not self.hold_until_stored or not tasks:
            return
        ids = {task.task_id for task in tasks}
        self._todo = type(self._todo)(t for t in self._todo if t.task_id not in ids)
        self._held += [(self.seq, task) for task in tasks]

    def report(self, task_id: int, worker_id: int, *args, **kwargs) -> ReportOutcome:
        # A worker that left mid-task leaves its rest as a task with a new id: held as a cut one.
        first_new = self._next_id
        outcome = super().report(task_id, worker_id, *args, **kwargs)
        self._hold([t for t in self._todo if t.task_id >= first_new])
        return outcome

    def snapshot(self, fingerprint: str = "", saved_at: float = 0.0) -> LedgerSnapshot:
        snapshot = super().snapshot(fingerprint, saved_at)
        if not self._held:
            return snapshot
        held = tuple(TaskRecord(t.task_id, t.shard.path, t.shard.start, t.shard.end, t.epoch, t.retries,
                                TaskState.TODO, -1, t.origin) for _, t in self._held)
        return dataclasses.replace(snapshot, tasks=snapshot.tasks + held)

    def restore(self, snapshot: LedgerSnapshot) -> None:
        super().restore(snapshot)
        self._held = []  # every task restored came from the store

    def close_stream(self, reason: str) -> None:
        """No more tasks come: the job ends once the tasks cut so far are done."""
        if self.stream_open:
            self.stream_open = False
            self.close_reason = reason
            logger.info("the stream is closed (%s): no record after the %d cut into tasks is trained",
                        reason, self.records_per_epoch)
            self._bump()

    def topic_deleted(self, reason: str) -> None:
        """The stream's topic is gone: no task that is not done can be read any more. The stream
        closes, the tasks not started are dropped, and a task that fails now (its records cannot
        be read) is not tried again. The tasks in progress may still finish (a read ahead)."""
        self.gone = reason
        self.close_stream(reason)
        self.stop()

    def _retry(self, task: Task, why: str) -> None:
        if self.gone:
            logger.warning("task %d (%s offsets %d-%d) is not tried again: %s", task.task_id, task.shard.path,
                           task.shard.start, task.shard.end - 1, self.gone)
            return
        super()._retry(task, why)

    def offsets(self) -> dict[str, int]:
        """Partition path -> one past the last offset cut into a task (kept or done): where the
        source goes on cutting after a resume."""
        ends: dict[str, int] = {}
        for task in self._every_task():
            ends[task.shard.path] = max(ends.get(task.shard.path, 0), task.shard.end)
        return ends

    @property
    def records_done(self) -> int:
        """Records done (trained, or skipped as bad): what an export taken now holds at least."""
        return self.epochs[0].records_done

    def newest_done(self) -> dict[str, int]:
        """Partition path -> one past the newest offset of a done task (an export's newest record)."""
        ends: dict[str, int] = {}
        for task in self._done.values():
            ends[task.shard.path] = max(ends.get(task.shard.path, 0), task.shard.end)
        return ends

    def compact(self, marks: Mapping[int, int] | None) -> int:
        """Fold each partition's done prefix, as far as a checkpoint cut with data position
        ``marks`` holds it (None: no cut to wait for), into the partition's compacted task; how
        many done tasks were folded. The prefix stops at the first offset not done (todo, in
        progress, fencing, dropped) and at the first done task the cut does not hold whole."""
        stops: dict[str, int] = {}
        busy = [*self._todo, *self._held_tasks, *(d.task for d in self._in_flight),
                *(t for e in self.epochs for t in e.dropped)]
        for task in busy:
            stops[task.shard.path] = min(stops.get(task.shard.path, task.shard.start), task.shard.start)
        for task in self._done.values():
            if marks is not None and task.task_id >= 0 and marks.get(task.task_id, task.origin) < task.shard.end:
                stops[task.shard.path] = min(stops.get(task.shard.path, task.origin), task.origin)
        folded = 0
        for path in {t.shard.path for t in self._done.values()}:
            mine = [t for t in self._done.values() if t.shard.path == path]
            compacted = next((t for t in mine if t.task_id < 0), None)
            upto = min(stops.get(path, max(t.shard.end for t in mine)), max(t.shard.end for t in mine))
            fold = [t for t in mine if t.task_id >= 0 and t.shard.end <= upto]
            if not fold:
                continue
            first = min([t.origin for t in fold] + ([compacted.origin] if compacted else []))
            end = max([t.shard.end for t in fold] + ([compacted.shard.end] if compacted else []))
            task_id = compacted.task_id if compacted else self._compacted_id()
            for task in fold:
                del self._done[task.task_id]
            self._done[task_id] = Task(task_id, TaskType.TRAINING, Shard(path, first, end), self.epoch, origin=first)
            folded += len(fold)
        if folded:
            self._bump()
        return folded

    def rewind(self, marks: dict[int, int], cause: str = "rollback") -> int:
        # Compacted records are in the cut (see ``compact``): they stay done.
        held = {t.task_id: t.shard.end for t in self._done.values() if t.task_id < 0}
        return super().rewind({**marks, **held}, cause)

    def done_below(self) -> int:
        """Every task id below it was folded by ``compact`` (done, held by the cut): no worker gets it
        again and no rewind asks for its mark, so the PS may drop its marks (ps/data_position.py)."""
        return min((t.task_id for t in self._every_task() if t.task_id >= 0), default=self._next_id)

    def _every_task(self) -> list[Task]:
        """Every task the ledger holds: todo, held, in progress, done (or folded) and dropped."""
        return [*self._todo, *self._held_tasks, *(d.task for d in self._in_flight), *self._done.values(),
                *(t for e in self.epochs for t in e.dropped)]

    def _compacted_id(self) -> int:
        return min((i for i in self._done if i < 0), default=0) - 1

    def consumed(self) -> dict[str, int]:
        """Partition path -> the first offset not consumed: every offset before it is done (or
        was dropped after --max_task_retries: never read again), none of todo or in progress.
        What --kafka_group commits to the broker. It goes back when a rollback puts done
        records back to todo, as the ledger does."""
        firsts: dict[str, int] = {}
        for task in [*self._todo, *self._held_tasks, *(d.task for d in self._in_flight)]:
            firsts[task.shard.path] = min(firsts.get(task.shard.path, task.shard.start), task.shard.start)
        return {path: min(end, firsts.get(path, end)) for path, end in self.offsets().items()}

    # ------------------------------------------------------------ the ledger, open-ended

    @property
    def _held_tasks(self) -> list[Task]:
        return [task for _, task in self._held]

    def get_task(self, worker_id: int) -> Task | NoTask:
        if (self.stream_open or self._held) and not self._todo and not self._stopped:
            self._requeue_timed_out()
            if not self._todo:
                return NoTask.WAIT  # records may still come
        return super().get_task(worker_id)

    def stop(self) -> int:
        self.close_stream("training stopped")
        dropped, self._held = len(self._held), []  # as the tasks not started in todo
        return super().stop() + dropped

    @property
    def finished(self) -> bool:
        return not self.stream_open and not self._held and super().finished

    @property
    def between_epochs(self) -> bool:
        return not self.stream_open and not self._held and super().between_epochs

    @property
    def records_per_epoch(self) -> int:
        return self.epochs[0].records_total if self.epochs else 0
