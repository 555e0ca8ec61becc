"""Cut a stream's new records into tasks, and tell when it went idle.

Given how far each partition holds records (``observe``: partition -> one past its last
offset known to exist), the cutter cuts what it has not cut yet into tasks of
``records_per_task`` offsets, in offset order, and remembers where it stopped. A partition's
last few records, short of a whole task, wait up to ``linger_secs`` for more to fill it: a
trickle of records then makes whole tasks, not one tiny task per look (each task costs a
read and a report). The stream is *idle* once ``idle_secs`` passed without a new record on
any partition (``--stream_idle_secs``); whatever still lingers is cut first (``flush``).

Pure: the caller gives the time (the job's clock, the tests' own). Where it starts is the
caller's choice: the ledger's offsets for a resumed job, else the partitions' first or next
offsets (``--stream_start earliest|latest``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from elasticdl.data.sources import Shard

# How long the records short of a whole task wait for more before they are a task of their own.
LINGER_SECS = 1.0


@dataclass
class StreamCutter:
    """``next_offsets``: partition -> the first offset not cut yet. ``path``: a partition's shard path."""

    next_offsets: dict[int, int]
    path: Callable[[int], str]
    records_per_task: int
    idle_secs: float
    started: float  # the time the stream was opened: idle counts from here until a record comes
    linger_secs: float = LINGER_SECS
    last_new: float = field(init=False)
    _seen: dict[int, int] = field(init=False)  # partition -> one past the last offset seen
    _waiting_since: dict[int, float] = field(init=False)  # partition -> when its uncut records were first seen

    def __post_init__(self) -> None:
        if self.records_per_task < 1:
            raise ValueError(f"records_per_task must be at least 1, got {self.records_per_task}")
        self.last_new = self.started
        self._seen = dict(self.next_offsets)
        self._waiting_since = {}

    def observe(self, ends: Mapping[int, int], now: float) -> list[Shard]:
        """The tasks for the records up to ``ends`` not cut yet: whole tasks at once, the rest
        once it waited ``linger_secs`` (an end at or before what was seen adds nothing: a
        watermark that went back, or an old probe)."""
        for partition in sorted(ends):
            if ends[partition] > self._seen.get(partition, 0):
                self._seen[partition] = ends[partition]
                self.last_new = now
        return self._cut(now, flush=False)

    def flush(self, now: float) -> list[Shard]:
        """Every record seen and not cut yet, as tasks now (the stream is about to close)."""
        return self._cut(now, flush=True)

    def seen_end(self, partition: int) -> int:
        """One past the last offset seen in ``partition`` (cut or lingering)."""
        return self._seen.get(partition, 0)

    def idle(self, now: float) -> bool:
        """No new record for ``idle_secs`` (0: never idle)."""
        return self.idle_secs > 0 and now - self.last_new >= self.idle_secs

    def _cut(self, now: float, flush: bool) -> list[Shard]:
        shards: list[Shard] = []
        per_task = self.records_per_task
        for partition in sorted(self._seen):
            start, end = self.next_offsets.get(partition, 0), self._seen[partition]
            whole = start + (end - start) // per_task * per_task
            since = self._waiting_since.get(partition, now)
            upto = end if flush or now - since >= self.linger_secs else whole
            shards += [Shard(self.path(partition), s, min(s + per_task, upto)) for s in range(start, upto, per_task)]
            self.next_offsets[partition] = max(start, upto)
            if self.next_offsets[partition] < end:
                self._waiting_since[partition] = since if upto == start else now
            else:
                self._waiting_since.pop(partition, None)
        return shards
