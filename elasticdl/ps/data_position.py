"""A PS shard's data position: per task, how far its records' gradients were applied.

Every training push names its task, the task's hand-out (a number the master gives each
time it hands a task out) and the record offset its batch ends at. The PS keeps:

- ``marks``: task id -> the record index (in the task's file) before which every batch's
  gradient was *applied* to this shard. A checkpoint stores them with the parameters, so a
  checkpoint knows exactly which records it holds: its data position.
- pushes *accepted* but not applied yet (sync mode: in the average, waiting for the
  others); they become applied with the version they are part of.
- ``records_applied``: records whose gradients this shard applied, over the whole job
  (restored with a checkpoint). The chaos tests check it against the data.
- fences: hand-outs the master took back (the task was requeued after its worker died, or
  the job rolled back to a checkpoint). A push of a fenced hand-out is refused, so its
  records are trained by the new hand-out only: never twice.

A push whose batch ends at or before its task's mark was already taken (a retry of a push
whose answer was lost): it is answered as taken and not applied again.

A stream's marks would grow with the stream, a task at a time: ``compact(done_below)`` drops
the marks of the tasks below an id that the master's ledger folded (done, and held by the
newest checkpoint cut: the ledger never rewinds or hands them out again, so nobody asks for
their marks). A late push of one of them is taken already.

Pure Python, no locking: the ParameterServer calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticdl.rpc.batch_position import BatchPosition


@dataclass
class DataPosition:
    marks: dict[int, int] = field(default_factory=dict)  # applied
    records_applied: int = 0
    fence_floor: int = 0  # hand-outs below it are refused (a rollback fences every earlier one)
    fenced: set[int] = field(default_factory=set)  # single hand-outs taken back (dead workers)
    done_below: int = 0  # a stream's tasks below this id are done and folded by the master (``compact``)
    _pending: list[BatchPosition] = field(default_factory=list)

    def refused(self, batch: BatchPosition) -> bool:
        """True if the batch's hand-out was fenced: the master gave its task to another worker."""
        return batch.handout < self.fence_floor or batch.handout in self.fenced

    def already_taken(self, batch: BatchPosition) -> bool:
        """True if this task's records up to ``records_end`` were already taken (a retried push)."""
        return batch.task_id < self.done_below or batch.records_end <= self.accepted_mark(batch.task_id)

    def accepted(self, batch: BatchPosition) -> None:
        """The strategy took the batch's gradient (applied or pending)."""
        self._pending.append(batch)

    def version_made(self) -> None:
        """The pushes taken so far are in the version just made: they are applied."""
        for batch in self._pending:
            self.marks[batch.task_id] = max(self.marks.get(batch.task_id, 0), batch.records_end)
            self.records_applied += batch.records
        self._pending.clear()

    def accepted_mark(self, task_id: int) -> int:
        """How far the task's pushes were taken (applied or waiting in the average; 0: none).

        Pending gradients are applied with the next version unless this PS dies, and then the
        job rolls back to a checkpoint anyway, so a requeued task may start after them."""
        pending = [b.records_end for b in self._pending if b.task_id == task_id]
        return max([self.marks.get(task_id, 0), *pending])

    def fence(self, handouts: list[int]) -> None:
        self.fenced.update(handouts)

    def compact(self, done_below: int) -> int:
        """Drop the marks of the tasks below ``done_below`` (see the module's docstring); how many."""
        if done_below <= self.done_below:
            return 0
        self.done_below = done_below
        gone = [task_id for task_id in self.marks if task_id < done_below]
        for task_id in gone:
            del self.marks[task_id]
        return len(gone)

    def restore(self, marks: dict[int, int], records_applied: int, fence_floor: int) -> None:
        """Back to a checkpoint's position; pending pushes are gone with the average they were in."""
        self.marks = dict(marks)
        self.records_applied = records_applied
        self.fence_floor = max(self.fence_floor, fence_floor)
        self.fenced = {h for h in self.fenced if h >= self.fence_floor}
        self._pending.clear()
