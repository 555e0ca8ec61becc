"""Cut a stream's new records into tasks, and tell when it went idle.

Given how far each partition holds records (``observe``: partition -> one past its last
offset known to exist), the cutter cuts what it has not cut yet into tasks of at most
``records_per_task`` offsets, in offset order, and remembers where it stopped. The stream is
*idle* once ``idle_secs`` passed without a new record on any partition (``--stream_idle_secs``).

Pure: the caller gives the time (the job's clock, the tests' own). Where it starts is the
caller's choice: the ledger's offsets for a resumed job, else the partitions' first or next
offsets (``--stream_start earliest|latest``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from elasticdl.data.sources import Shard


@dataclass
class StreamCutter:
    """``next_offsets``: partition -> the first offset not cut yet. ``path``: a partition's shard path."""

    next_offsets: dict[int, int]
    path: Callable[[int], str]
    records_per_task: int
    idle_secs: float
    started: float  # the time the stream was opened: idle counts from here until a record comes
    last_new: float = field(init=False)

    def __post_init__(self) -> None:
        if self.records_per_task < 1:
            raise ValueError(f"records_per_task must be at least 1, got {self.records_per_task}")
        self.last_new = self.started

    def observe(self, ends: Mapping[int, int], now: float) -> list[Shard]:
        """The tasks for the records up to ``ends`` not cut yet (an end at or before where a
        partition's cutting stands adds nothing: a watermark that went back, or an old probe)."""
        shards: list[Shard] = []
        for partition in sorted(ends):
            start, end = self.next_offsets.get(partition, 0), ends[partition]
            if end <= start:
                continue
            path = self.path(partition)
            shards += [Shard(path, s, min(s + self.records_per_task, end))
                       for s in range(start, end, self.records_per_task)]
            self.next_offsets[partition] = end
        if shards:
            self.last_new = now
        return shards

    def idle(self, now: float) -> bool:
        """No new record for ``idle_secs`` (0: never idle)."""
        return self.idle_secs > 0 and now - self.last_new >= self.idle_secs

    def quiet_for(self, now: float) -> float:
        return now - self.last_new
