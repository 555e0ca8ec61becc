"""A stream source in the simulator (``--mode stream``, issue 27): a simulated broker whose
partitions receive the job's records over simulated time, watched by the real master's source.

``SimTopic`` stands where ``KafkaTopic`` stood (``watermarks``, ``probe``, ``end``): records
arrive at seeded times, and, like Tansu 0.6 with batching producers, a watermark may
under-report a partition's end (the source must read past it before calling it quiet). The
broker can be cut off (an outage the source waits out). ``KafkaStreamSource`` (the real one,
without its thread: the simulated master polls it every ``POLL_SECS``), ``StreamCutter`` and
``StreamTaskManager`` are the real code: tasks are offset ranges of partitions cut from the
watermarks as records arrive, no epochs, and the job ends once the stream was idle.

The job's records are numbered 0..N-1 in arrival order (the oracle's keys, as a file's record
indices); ``records_at`` maps a partition's offsets back to them.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticdl.data.kafka_address import KafkaAddress

ARRIVAL_SECONDS = 2.5  # the producer writes every record within this long of the start
IDLE_SECONDS = 1.5  # --stream_idle_secs


class BrokerDown(ConnectionError):
    """The broker does not answer (cut off by the nemesis)."""


@dataclass
class SimTopic:
    """``partitions`` partitions; record ``i`` (arrival order) is at ``placement[i]`` =
    (partition, offset) from ``arrivals[i]`` seconds on."""

    clock: object
    rng: object
    partitions: int
    arrivals: list[float]
    placement: list[tuple[int, int]]
    available: bool = True
    address: KafkaAddress = field(default_factory=lambda: KafkaAddress("sim:9092", "records"))
    _times: dict[int, list[float]] = field(default_factory=dict)  # partition -> arrival of each offset
    _index: dict[int, list[int]] = field(default_factory=dict)  # partition -> record of each offset
    under_reports: dict[int, int] = field(default_factory=dict)  # partition -> records its watermark leaves out

    @classmethod
    def generate(cls, clock, rng, records: int) -> SimTopic:
        partitions = rng.randint(1, 3)
        arrivals = sorted(rng.uniform(0.0, ARRIVAL_SECONDS) for _ in range(records))
        counts = [0] * partitions
        placement = []
        for _ in range(records):
            p = rng.randrange(partitions)
            placement.append((p, counts[p]))
            counts[p] += 1
        topic = cls(clock, rng, partitions, arrivals, placement)
        # Some partitions' watermarks stay short of their end, as Tansu 0.6's with batching producers.
        topic.under_reports = {p: rng.randint(1, 4) for p in range(partitions) if rng.random() < 0.3}
        for record, (p, _) in enumerate(placement):
            topic._times.setdefault(p, []).append(arrivals[record])
            topic._index.setdefault(p, []).append(record)
        return topic

    def _end(self, partition: int) -> int:
        """One past the last offset that arrived by now."""
        return bisect.bisect_right(self._times.get(partition, []), self.clock())

    def _check(self) -> None:
        if not self.available:
            raise BrokerDown("sim:9092: the broker does not answer")

    # ------------------------------------------------------------ KafkaTopic's calls

    def watermarks(self, partition: int, timeout: float = 5.0) -> tuple[int, int]:
        self._check()
        return 0, max(0, self._end(partition) - self.under_reports.get(partition, 0))

    def probe(self, starts: Mapping[int, int], limit: int, wait: float = 0.0) -> dict[int, int]:
        self._check()
        return {p: max(start, min(self._end(p), start + limit)) for p, start in starts.items()}

    def end(self, partition: int, limit: int = 10_000) -> int:
        self._check()
        return self._end(partition)

    def partition_ids(self) -> list[int]:
        return list(range(self.partitions))

    def exists(self, timeout: float = 5.0) -> bool:
        """The source lists the topics at every poll (a deleted topic ends the job): never deleted here."""
        self._check()
        return True

    def close(self) -> None:
        """KafkaTopic's: its fetch helper process (none here)."""

    # ------------------------------------------------------------ the workers' reads

    def records_at(self, path: str, offsets: list[int]) -> list[int]:
        """The job's record numbers at ``offsets`` of the partition of shard path ``path``."""
        partition = int(path.rsplit("#", 1)[1])
        index = self._index[partition]
        return [index[o] for o in offsets]
