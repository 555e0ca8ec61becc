"""The master's Kafka source: watch the partitions, cut new records into tasks, end when idle.

A thread of its own asks the broker, every ``poll_secs``, how far each partition holds
records: the high watermark, and for a partition whose watermark did not move, a read past it
(``KafkaTopic.probe``: a broker may under-report the watermark). What it finds goes through
the ``StreamCutter``; the tasks it cuts wait in a queue until the job loop, the only thread
that touches the ledger, takes them (``feed``). Once no record came for
``--stream_idle_secs``, ``feed`` closes the ledger's stream and the job ends after the tasks cut.

A broker that cannot be reached is waited out (logged once per outage): its time does not
count as idle, and cutting goes on from where it stood when it answers again.

The consumer lag (``lag``): per partition, the records behind its end, as Kafka's lag monitors
count it: how far the partition was seen (its high watermark, or past it) minus the ledger's
consumed offset (the first offset not done). ``feed`` measures it at most every ``LAG_SECS``,
for the progress line and TensorBoard; the report's ``stream`` has it at the end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from elasticdl.data.kafka_address import is_kafka
from elasticdl.data.kafka_client import GroupOffsets, KafkaTopic
from elasticdl.master.stream_cutter import StreamCutter
from elasticdl.master.stream_tasks import StreamTaskManager

logger = logging.getLogger(__name__)

POLL_SECS = 0.5
# A poll that gets no answer within this long counts as a broker outage (waited out).
BROKER_TIMEOUT_SECS = 5.0
# A probe past the watermarks reads at most about this many tasks' records of a partition per poll.
PROBE_TASKS = 8
# --kafka_group: the consumed offsets are committed at most this often (and once at the end).
COMMIT_SECS = 1.0
# How often the ledger's done prefix is compacted (after a look for a newer checkpoint cut).
COMPACT_SECS = 30.0
# The consumer lag is measured at most this often (the ledger is walked for it).
LAG_SECS = 1.0


class KafkaStreamSource:
    """``open`` (where to start), then ``feed`` the ledger from the job loop; ``close`` at the end."""

    def __init__(self, topic: KafkaTopic, partitions: list[int], records_per_task: int, idle_secs: float,
                 start: str = "earliest", clock: Callable[[], float] = time.monotonic,
                 poll_secs: float = POLL_SECS, timeout: float = BROKER_TIMEOUT_SECS,
                 group: GroupOffsets | None = None,
                 cut_marks: Callable[[], dict[int, int] | None] | None = None, compact_freely: bool = False,
                 stored_seq: Callable[[], int] | None = None, forget_marks: Callable[[int], None] | None = None):
        self.topic = topic
        self.partitions = partitions
        self.records_per_task = records_per_task
        self.idle_secs = idle_secs
        self.start = start
        self.clock = clock
        self.poll_secs = poll_secs
        self.timeout = timeout
        self.cutter: StreamCutter | None = None
        self._cut: queue.SimpleQueue = queue.SimpleQueue()  # lists of shards, for the job loop
        self._idle = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outage = ""
        self.deleted = ""  # why the stream ended when its topic was deleted ('' while it exists)
        self.starts: dict[int, int] = {}
        # --kafka_group: the ledger's consumed offsets, committed by the watching thread (the
        # job loop only hands them over), and once more at the end (``close``).
        self.group = group
        self._ledger: StreamTaskManager | None = None
        self._to_commit: dict[int, int] = {}
        self._committed: dict[int, int] = {}
        self._consumed_at = float("-inf")
        self._commit_lock = threading.Lock()
        # Compaction (StreamTaskManager.compact): ``cut_marks`` reads the newest checkpoint cut's
        # data position on the watching thread (None: none yet); ``compact_freely`` (no
        # --checkpoint_dir: no rollback is exact anyway) compacts the done prefix as it is;
        # neither: never. The marks found wait here for the job loop.
        self.cut_marks = cut_marks
        self.compact_freely = compact_freely
        self._marks: queue.SimpleQueue = queue.SimpleQueue()
        self._compact_at = clock() + COMPACT_SECS
        self._marks_at = clock() + COMPACT_SECS
        # The newest ledger seq the state store holds: ``feed`` releases the tasks cut before it
        # (StreamTaskManager.stored; a ledger that does not hold its tasks hands them out at once).
        self.stored_seq = stored_seq
        # After each compaction, the PS drop the marks of the tasks folded (``forget_marks(done_below)``,
        # on the watching thread; sent again after the next one, for a PS restarted from a cut meanwhile).
        self.forget_marks = forget_marks
        self._forget: queue.SimpleQueue = queue.SimpleQueue()
        self.lag: dict[int, int] = {}  # partition -> consumer lag, as ``feed`` last measured it
        self._lag_at = float("-inf")

    def open(self, committed: dict[str, int], watch: bool = True) -> dict[int, int]:
        """Start watching from the ledger's ``committed`` offsets (path -> end cut), or, for a
        partition the ledger never cut, from ``--stream_start``; the offsets it starts from.
        ``watch=False``: no thread (tests call ``poll_once`` themselves)."""
        address = self.topic.address
        starts: dict[int, int] = {}
        for partition in self.partitions:
            path = address.partition_path(partition)
            if path in committed:
                starts[partition] = committed[path]
                continue
            # latest: past every record the partition holds now (read past its watermark)
            starts[partition] = (self.topic.watermarks(partition)[0] if self.start == "earliest"
                                 else self.topic.end(partition))
        resumed = {p: o for p, o in starts.items() if address.partition_path(p) in committed}
        logger.info("stream %s: partitions %s start at offsets %s (%s)", address.url, self.partitions, starts,
                    f"the ledger's for {sorted(resumed)}" if resumed else f"--stream_start {self.start}")
        self.starts = dict(starts)
        self.cutter = StreamCutter(dict(starts), address.partition_path, self.records_per_task,
                                   self.idle_secs, self.clock())
        if watch:
            self._thread = threading.Thread(target=self._watch, name="stream-source", daemon=True)
            self._thread.start()
        return starts

    def feed(self, ledger: StreamTaskManager) -> int:
        """In the job loop: add the tasks cut since the last call; close the stream once it is
        idle. How many records were added."""
        added = 0
        if self.stored_seq is not None:  # the tasks a write since the last call put in the store
            ledger.stored(self.stored_seq())
        while True:
            try:
                shards = self._cut.get_nowait()
            except queue.Empty:
                break
            ledger.add(shards)
            added += sum(s.records for s in shards)
        if self.deleted and ledger.stream_open:
            ledger.topic_deleted(self.deleted)
        if self._idle.is_set() and ledger.stream_open:
            ledger.close_stream(f"no new record for {self.idle_secs:g} s (--stream_idle_secs)")
        if self.group is not None:
            self._hand_over_consumed(ledger)
        if self.clock() - self._lag_at >= LAG_SECS:
            self._lag_at = self.clock()
            self.lag = self.consumer_lag(ledger)
        self._compact(ledger)
        if not ledger.stream_open:  # idle, or closed by a stop: nothing more is cut
            self._stop_watching()
        return added

    def consumer_lag(self, ledger: StreamTaskManager) -> dict[int, int]:
        """Partition -> records behind its end: seen (the watermark, or past it) minus consumed
        (the first offset the ledger does not hold done; a partition never cut: where it started)."""
        if self.cutter is None:
            return {}
        consumed, path = ledger.consumed(), self.topic.address.partition_path
        return {p: max(0, self.cutter.seen_end(p) - consumed.get(path(p), self.starts.get(p, 0)))
                for p in self.partitions}

    @property
    def total_lag(self) -> int | None:
        """The consumer lag summed over the partitions, as last measured (None before the first)."""
        return sum(self.lag.values()) if self.lag else None

    def lag_scalars(self) -> dict[str, int]:
        """TensorBoard's: ``stream/consumer_lag`` (summed) and one per partition."""
        if not self.lag:
            return {}
        return {"stream/consumer_lag": sum(self.lag.values()),
                **{f"stream/consumer_lag/partition_{p}": lag for p, lag in sorted(self.lag.items())}}

    def summary(self, ledger: StreamTaskManager) -> dict:
        """The report's ``stream``: how it closed, the consumer lag summed, and per partition where
        it started, how far it was cut, consumed (done) and seen, and its consumer lag (records
        seen and not consumed: 0 at the end of a job that trained every record it saw)."""
        cutter, cut = self.cutter, ledger.offsets()  # the ledger's: what was cut and not dropped by a close
        lag = self.consumer_lag(ledger)
        consumed = ledger.consumed()
        partitions = {}
        for p in self.partitions if cutter is not None else ():
            path = self.topic.address.partition_path(p)
            start = self.starts.get(p, 0)
            partitions[str(p)] = {"start": start, "cut_to": cut.get(path, start), "consumed": consumed.get(path, start),
                                  "seen": cutter.seen_end(p), "lag": lag[p]}
        return {"url": self.topic.address.url, "closed": ledger.close_reason if not ledger.stream_open else "",
                "records_cut": ledger.records_per_epoch, "lag": sum(lag.values()), "partitions": partitions}

    def close(self) -> None:
        """The job ended: stop watching; with --kafka_group, commit the ledger's consumed offsets
        as they are at the end (also after a failure: what the ledger counts done is done)."""
        self._stop_watching()
        if self.group is None:
            return
        if self._ledger is not None:
            self._hand_over_consumed(self._ledger, force=True)
        self.commit_consumed()
        self.group.close()
        self.group = None

    def _stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.topic.close()  # its helper process, if any (the exports' timestamps start it again)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self.commit_consumed()
            self.look_for_cut()
            self.forget_folded_marks()
            if self._idle.is_set():
                return
            self._stop.wait(self.poll_secs)

    def _topic_gone(self) -> None:
        address = self.topic.address
        self.deleted = (f"the topic {address.topic!r} was deleted from {address.brokers} while the job ran")
        logger.error("stream %s: %s: training stops; the records trained so far go into the final checkpoint "
                     "and export, and the job then fails", address.url, self.deleted)
        self._stop.set()  # nothing more to watch

    def raise_if_deleted(self) -> None:
        """After the job's end (its final checkpoint, export and report): fail it if the topic went."""
        if self.deleted:
            from elasticdl.errors import JobFailedError

            raise JobFailedError(
                f"{self.deleted} (--training_data {self.topic.address.url}): the records trained before are in the "
                "final checkpoint and export; report.json's stream gives each partition's offsets trained; the "
                "records cut and not trained went with the topic. Recreate the topic and start a new job (the "
                "offsets of a new topic start over), or restore the topic and resume with --etcd_endpoints")

    def look_for_cut(self) -> None:
        """On the watching thread, every COMPACT_SECS: the newest cut's marks, for ``feed`` to compact."""
        if self.cut_marks is None or self.clock() < self._marks_at:
            return
        self._marks_at = self.clock() + COMPACT_SECS
        try:
            marks = self.cut_marks()
        except Exception as err:  # a checkpoint being written, a store away: the next look tries again
            logger.info("stream %s: no checkpoint cut read for compaction (%s)", self.topic.address.url, err)
            return
        if marks is not None:
            self._marks.put(marks)

    def _compact(self, ledger: StreamTaskManager) -> None:
        """In the job loop: fold the done prefix the newest cut holds (without checkpoints, every
        COMPACT_SECS, all of it)."""
        found = None
        while True:
            try:
                found = self._marks.get_nowait()
            except queue.Empty:
                break
        if found is None and self.compact_freely and self.clock() >= self._compact_at:
            self._compact_at = self.clock() + COMPACT_SECS
            ledger.compact(None)
        elif found is not None:
            ledger.compact(found)
        else:
            return
        if self.forget_marks is not None and ledger.done_below() > 0:
            self._forget.put(ledger.done_below())

    def forget_folded_marks(self) -> None:
        """On the watching thread: the PS drop the marks of the tasks the last compaction folded. A PS
        that does not answer is logged; the next compaction sends it again."""
        floor = None
        while True:
            try:
                floor = self._forget.get_nowait()
            except queue.Empty:
                break
        if floor is None or self.forget_marks is None:
            return
        try:
            self.forget_marks(floor)
        except Exception as err:  # a PS restarting, a newer master: the next compaction sends it again
            logger.info("stream %s: the PS did not drop the marks of tasks below %d (%s)",
                        self.topic.address.url, floor, err)

    def _hand_over_consumed(self, ledger: StreamTaskManager, force: bool = False) -> None:
        """In the job loop: the ledger's consumed offsets for the committing thread (at most every
        COMMIT_SECS: the ledger is walked for them)."""
        self._ledger = ledger
        now = self.clock()
        if not force and now - self._consumed_at < COMMIT_SECS:
            return
        self._consumed_at = now
        consumed = ledger.consumed()
        offsets = {p: consumed[self.topic.address.partition_path(p)] for p in self.partitions
                   if self.topic.address.partition_path(p) in consumed}
        with self._commit_lock:
            self._to_commit = offsets

    def commit_consumed(self) -> None:
        """Commit the consumed offsets handed over, if they moved since the last commit. A broker
        that refuses is logged and tried again at the next call: the group's offsets are for
        lag monitors, the ledger holds the truth."""
        with self._commit_lock:  # held for the copy only: the job loop never waits on the broker
            offsets = dict(self._to_commit)
        group = self.group
        if group is None or offsets == self._committed:
            return
        try:
            group.commit(offsets)
        except Exception as err:  # the broker away: training goes on, the next call tries again
            logger.warning("stream %s: consumed offsets not committed under --kafka_group %s (%s); "
                           "trying again", self.topic.address.url, group.group, err)
            return
        self._committed = offsets

    def poll_once(self) -> None:
        """One look at the partitions: cut what is new, and tell when the stream went idle."""
        cutter = self.cutter
        try:
            # Listed first: a deleted topic's watermarks may read (0, 0) (Tansu), which would look idle.
            if not self.topic.exists(self.timeout):
                self._topic_gone()
                return
            ends: dict[int, int] = {}
            for partition in self.partitions:
                _low, high = self.topic.watermarks(partition, self.timeout)
                ends[partition] = high
            quiet = {p: cutter.seen_end(p) for p, end in ends.items() if end <= cutter.seen_end(p)}
            # Before calling a partition quiet, read past its watermark: the records may be there.
            for partition, end in self.topic.probe(quiet, self.records_per_task * PROBE_TASKS).items():
                ends[partition] = max(ends[partition], end)
        except Exception as err:  # the broker is away: wait it out; its time is not idle time
            if not self._outage:
                logger.warning("stream %s: the broker does not answer (%s); waiting for it",
                               self.topic.address.url, err)
            self._outage = str(err)
            cutter.last_new = self.clock()
            return
        if self._outage:
            logger.info("stream %s: the broker answers again", self.topic.address.url)
            self._outage = ""
        now = self.clock()
        shards = cutter.observe(ends, now)  # a new record resets the idle time
        idle = cutter.idle(now)
        if idle:
            shards += cutter.flush(now)  # what lingers, short of a whole task
        if shards:
            self._cut.put(shards)
        if idle:
            self._idle.set()  # after the last cut: feed adds it before it closes the stream


def stream_ledger(config, command: str) -> StreamTaskManager | None:
    """The training ledger of a stream job (``--training_data kafka://...``); None for files."""
    if command != "train" or not is_kafka(config.data.training_data):
        return None
    return StreamTaskManager(
        task_timeout=config.elasticity.task_timeout,
        max_task_retries=config.elasticity.max_task_retries,
        seed=config.data.shuffle_seed,
        gate_epochs=True,
        fences_pushes=True,  # a task taken back waits for FenceHandouts, as a file task does
        clock=time.monotonic,  # --task_timeout: a frozen worker's task comes back
    )


def open_stream(config, ledger, term_floor: int = -1, stored_seq: Callable[[], int] | None = None,
                forget_marks: Callable[[int], None] | None = None) -> KafkaStreamSource | None:
    """Start watching the stream of a stream job's ledger (after the ledger was resumed: it
    goes on from the ledger's offsets); None for a file job. ``term_floor``: the checkpoint
    lineage of this job (its cuts have terms above it). ``stored_seq``: the newest ledger seq
    the state store holds: the ledger then hands out only the tasks the store holds.
    ``forget_marks(done_below)``: the PS drop the marks of the tasks the ledger folded."""
    if not isinstance(ledger, StreamTaskManager):
        return None
    ledger.hold_until_stored = stored_seq is not None
    directory = config.checkpoints.checkpoint_dir
    cut_marks = NewestCutMarks(directory, term_floor) if directory else None
    # Records are fetched in a helper process: the master outlives a deleted topic (kafka_client._fetching).
    topic = KafkaTopic.of(config.data.training_data, keep_consumers=False, fetch_elsewhere=True)
    group = GroupOffsets(topic.address, config.stream.kafka_group) if config.stream.kafka_group else None
    source = KafkaStreamSource(topic, topic.partitions(), config.effective_records_per_task,
                               config.stream.stream_idle_secs, config.stream.stream_start, group=group,
                               cut_marks=cut_marks, compact_freely=not directory, stored_seq=stored_seq,
                               forget_marks=forget_marks)
    source.open(ledger.offsets())
    return source


class NewestCutMarks:
    """The data position of the newest verified cut of a lineage; None before there is one.
    The directory is listed each call, and a cut is read (verified) only when a newer one is complete."""

    def __init__(self, directory: str, term_floor: int = -1):
        self.directory = directory
        self.term_floor = term_floor
        self._seen = -1
        self._marks: dict[int, int] | None = None

    def __call__(self) -> dict[int, int] | None:
        from elasticdl.master.cut_recovery import latest_cut
        from elasticdl.model.checkpoint import complete_versions

        versions = complete_versions(self.directory, self.term_floor)  # oldest first
        if versions and versions[-1] != self._seen:
            self._seen = versions[-1]
            cut = latest_cut(self.directory, self.term_floor)  # the newest that verifies
            if cut is not None:
                self._marks = dict(cut.marks)
        return self._marks
