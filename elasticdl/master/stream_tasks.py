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

Pure Python, like the file ledger: no clock, no thread, no call out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from elasticdl.data.sources import Shard
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.tasks import NoTask, Task, TaskType

logger = logging.getLogger(__name__)


class StreamTaskManager(TaskManager):
    """A training ledger fed by a stream source. ``add`` tasks, ``close_stream`` to end."""

    _open_ended = True

    def __init__(self, **kwargs):
        super().__init__([], num_epochs=1, task_type=TaskType.TRAINING, shuffle=False, **kwargs)
        self.stream_open = True
        self.close_reason = ""

    # ------------------------------------------------------------ the source

    def add(self, shards: Sequence[Shard]) -> int:
        """Append a task for each shard (records that arrived); how many were added (none once
        the stream is closed or training stopped)."""
        if not self.stream_open or self._stopped or not shards:
            return 0
        stats = self.epochs[self.epoch]
        for shard in shards:
            self._todo.append(Task(self._next_id, TaskType.TRAINING, shard, self.epoch))
            self._next_id += 1
            stats.records_total += shard.records
        self._bump()
        return len(shards)

    def close_stream(self, reason: str) -> None:
        """No more tasks come: the job ends once the tasks cut so far are done."""
        if self.stream_open:
            self.stream_open = False
            self.close_reason = reason
            logger.info("the stream is closed (%s): no record after the %d cut into tasks is trained",
                        reason, self.records_per_epoch)
            self._bump()

    def offsets(self) -> dict[str, int]:
        """Partition path -> one past the last offset cut into a task (kept or done): where the
        source goes on cutting after a resume."""
        tasks = [*self._todo, *(d.task for d in self._in_flight), *self._done.values(),
                 *(t for e in self.epochs for t in e.dropped)]
        ends: dict[str, int] = {}
        for task in tasks:
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

    def consumed(self) -> dict[str, int]:
        """Partition path -> the first offset not consumed: every offset before it is done (or
        was dropped after --max_task_retries: never read again), none of todo or in progress.
        What --kafka_group commits to the broker. It goes back when a rollback puts done
        records back to todo, as the ledger does."""
        firsts: dict[str, int] = {}
        for task in [*self._todo, *(d.task for d in self._in_flight)]:
            firsts[task.shard.path] = min(firsts.get(task.shard.path, task.shard.start), task.shard.start)
        return {path: min(end, firsts.get(path, end)) for path, end in self.offsets().items()}

    # ------------------------------------------------------------ the ledger, open-ended

    def get_task(self, worker_id: int) -> Task | NoTask:
        if self.stream_open and not self._todo and not self._stopped:
            self._requeue_timed_out()
            if not self._todo:
                return NoTask.WAIT  # records may still come
        return super().get_task(worker_id)

    def stop(self) -> int:
        self.close_stream("training stopped")
        return super().stop()

    @property
    def finished(self) -> bool:
        return not self.stream_open and super().finished

    @property
    def between_epochs(self) -> bool:
        return not self.stream_open and super().between_epochs

    @property
    def records_per_epoch(self) -> int:
        return self.epochs[0].records_total if self.epochs else 0
