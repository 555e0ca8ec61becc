"""A Kafka topic through confluent-kafka (librdkafka): checks, partition ends, offset ranges.

No consumer group: a reader assigns itself one partition and seeks to an offset, so any
worker can read any task's range and the master, not the broker, keeps what was consumed
(the ledger). Used by the master (submit checks, ``ends``: how far each partition has
records) and by the workers (``read``: a task's records).

High watermarks are a hint, not the truth: Tansu 0.6.0 under-reports a partition's high
watermark when producers batch (7,713 for 10,000 records held), while the records read back
with their offsets. ``ends`` therefore reads past the watermark (``probe``) before it calls a
partition idle, and a range is cut only up to offsets seen to exist. Real Kafka reports
watermarks correctly; both pass the same code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from elasticdl.data.errors import DataError
from elasticdl.data.kafka_address import KafkaAddress, parse_kafka_url, parse_partition_path

# How long a submit-time check waits for the broker before calling it unreachable.
CHECK_TIMEOUT_SECS = 5.0
# How long a worker waits for a task's records before failing the task (retried by the master).
READ_TIMEOUT_SECS = 60.0
# How long a probe past the watermarks waits to reach the partitions' ends (it returns at once
# when the broker says it did; a fresh assignment's first fetch can take a few hundred ms).
PROBE_WAIT_SECS = 2.0

# One consume() call's wait: it returns when it has all the records asked for, or after this.
CONSUME_SECS = 0.05

_PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent dies
_local = threading.local()  # one consumer per thread and cluster (a worker reads ahead in threads)


def _client_module():
    try:
        import confluent_kafka
    except ImportError:
        raise DataError(
            "kafka:// data needs the confluent-kafka client: pip install 'elasticdl[kafka]'"
        ) from None
    return confluent_kafka


def _consumer(brokers: str):
    consumers = getattr(_local, "consumers", None)
    if consumers is None:
        consumers = _local.consumers = {}
    if brokers not in consumers:
        consumers[brokers] = _new_consumer(brokers)
    return consumers[brokers]


@contextmanager
def _fetching(brokers: str, keep: bool) -> Iterator:
    """A consumer to fetch records with: this thread's own (``keep``), or one closed after use.

    Tansu 0.6.0 and librdkafka (confluent-kafka 2.16.1): a process whose consumer fetched
    records of a topic, and is still open when the topic is deleted, dies with SIGSEGV in a
    librdkafka thread within a second (a null topic name in a metadata answer, it seems:
    ``rd_kafka_metadata_cache_find`` -> ``strcmp``). One that only asked for watermarks or
    committed offsets, or whose fetching consumer was closed, lives on. So the master fetches
    in a helper process (``FetchHelper``: probes and timestamps, while the job runs) or with
    consumers it closes at once (the submit check's sample): it outlives a deleted topic and
    fails the job clearly. A worker keeps its consumer (a task's read is its hot path); on
    Tansu it dies with the topic, and the master, which knows why, ends the job."""
    if keep:
        yield _consumer(brokers)
        return
    consumer = _new_consumer(brokers)
    try:
        yield consumer
    finally:
        consumer.close()


def _new_consumer(brokers: str):
    kafka = _client_module()
    return kafka.Consumer({
            "bootstrap.servers": brokers,
            "group.id": "elasticdl",  # never joined: partitions are assigned, offsets never committed
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "allow.auto.create.topics": False,
            "enable.partition.eof": True,  # a probe knows when it read a partition to its end
            "fetch.wait.max.ms": 100,  # ... within 0.1 s of it (the broker holds an empty fetch this long)
            "log_level": 0,  # failures reach the caller as errors; librdkafka would print each retry
    })


class KafkaTopic:
    """One topic of one cluster, as the master and the workers read it."""

    def __init__(self, address: KafkaAddress, keep_consumers: bool = True, fetch_elsewhere: bool = False):
        """``keep_consumers=False``: records are fetched with consumers closed after use.
        ``fetch_elsewhere``: ``probe`` and ``timestamps`` fetch in a helper process (the
        master's source, which must outlive a deleted topic: see ``_fetching``)."""
        self.address = address
        self.keep_consumers = keep_consumers
        self._admin = None  # for ``exists``, made on first use
        self._helper = FetchHelper() if fetch_elsewhere else None

    @classmethod
    def of(cls, url: str, flag: str = "--training_data", keep_consumers: bool = True,
           fetch_elsewhere: bool = False) -> KafkaTopic:
        return cls(parse_kafka_url(url, flag), keep_consumers, fetch_elsewhere)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()

    def exists(self, timeout: float = CHECK_TIMEOUT_SECS) -> bool:
        """Whether the brokers list the topic (a DataError when they cannot be reached). The
        topics are listed, never asked for by name: a deleted topic is not created again."""
        kafka = _client_module()
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            self._admin = AdminClient({"bootstrap.servers": self.address.brokers, "log_level": 0})
        try:
            topics = self._admin.list_topics(timeout=timeout).topics
        except kafka.KafkaException as err:
            raise DataError(f"the Kafka brokers {self.address.brokers} do not answer: "
                            f"{err.args[0].str() if err.args else err}") from None
        meta = topics.get(self.address.topic)
        return meta is not None and meta.error is None

    def partitions(self, flag: str = "--training_data", timeout: float = CHECK_TIMEOUT_SECS) -> list[int]:
        """The topic's partitions; a DataError naming ``flag`` when the brokers cannot be reached
        or the topic does not exist (the topics are listed, never asked for by name: a broker
        that creates topics on a metadata request would create it)."""
        kafka = _client_module()
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.address.brokers, "log_level": 0})
        try:
            topics = admin.list_topics(timeout=timeout).topics
        except kafka.KafkaException as err:
            raise DataError(
                f"{flag}: the Kafka brokers {self.address.brokers} cannot be reached within {timeout:g} s "
                f"({err.args[0].str() if err.args else err}): check the address in {flag} and that the "
                "brokers run and are reachable from the master"
            ) from None
        meta = topics.get(self.address.topic)
        if meta is None or meta.error is not None:
            known = ", ".join(sorted(t for t in topics if not t.startswith("__"))[:10]) or "none"
            raise DataError(
                f"{flag}: the topic {self.address.topic!r} does not exist on {self.address.brokers} "
                f"(topics there: {known}): create it, or name another in {flag}"
            )
        return sorted(meta.partitions)

    def watermarks(self, partition: int, timeout: float = CHECK_TIMEOUT_SECS) -> tuple[int, int]:
        """(low, high) watermark of ``partition``: the first offset held, and one past the last
        (a hint: see the module's docstring)."""
        kafka = _client_module()
        tp = kafka.TopicPartition(self.address.topic, partition)
        low, high = _consumer(self.address.brokers).get_watermark_offsets(tp, timeout=timeout, cached=False)
        return low, high

    def probe(self, starts: Mapping[int, int], limit: int, wait: float = PROBE_WAIT_SECS) -> dict[int, int]:
        """For each partition, one past the last offset seen from ``starts[partition]`` on, reading
        until the partition's end (the broker's end-of-partition event), at most about ``limit``
        records of it, or ``wait`` seconds (``starts[partition]`` when none came)."""
        if self._helper is not None:
            return self._helper.call(_probe_there, self.address, dict(starts), limit, wait)
        kafka = _client_module()
        with _fetching(self.address.brokers, self.keep_consumers) as consumer:
            ends = dict(starts)
            if not starts:
                return ends
            consumer.assign([kafka.TopicPartition(self.address.topic, p, o) for p, o in starts.items()])
            at_end: set[int] = set()
            seen = 0
            try:
                deadline = time.monotonic() + wait
                while len(at_end) < len(starts) and seen < limit * len(starts):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    # consume() waits for all num_messages or its timeout: short calls, so that an end
                    # reached early is seen early.
                    for message in consumer.consume(num_messages=min(limit, 10_000), timeout=min(left, CONSUME_SECS)):
                        error = message.error()
                        if error is not None:
                            if error.code() == kafka.KafkaError._PARTITION_EOF:
                                at_end.add(message.partition())
                            continue
                        if message.offset() >= ends.get(message.partition(), 0):
                            ends[message.partition()] = message.offset() + 1
                            seen += 1
            finally:
                consumer.unassign()
            return ends

    def end(self, partition: int, limit: int = 10_000) -> int:
        """One past the last offset ``partition`` holds now: its watermark, then read past it
        until no more come (``limit`` records a read)."""
        end = self.watermarks(partition)[1]
        while True:
            found = self.probe({partition: end}, limit)[partition]
            if found <= end:
                return end
            end = found

    def read(self, partition: int, start: int, end: int, timeout: float = READ_TIMEOUT_SECS) -> list[bytes]:
        """The values of the records at offsets ``start`` .. ``end - 1`` of ``partition``, in order.

        A DataError when they do not all arrive within ``timeout`` or an offset is missing
        (deleted by retention, or a compacted or transactional topic): a task holds every
        offset of its range."""
        kafka = _client_module()
        if end <= start:
            return []
        with _fetching(self.address.brokers, self.keep_consumers) as consumer:
            where = f"{self.address.partition_path(partition)} offsets {start}-{end - 1}"
            consumer.assign([kafka.TopicPartition(self.address.topic, partition, start)])
            values: list[bytes] = []
            try:
                deadline = time.monotonic() + timeout
                while start + len(values) < end:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DataError(f"{where}: only {len(values)} of {end - start} records arrived within "
                                        f"{timeout:g} s: is the broker reachable from the worker?")
                    for message in consumer.consume(num_messages=min(end - start - len(values), 10_000),
                                                    timeout=min(left, CONSUME_SECS)):
                        error = message.error()
                        if error is not None:
                            if error.code() != kafka.KafkaError._PARTITION_EOF and (error.fatal() or not error.retriable()):
                                raise DataError(f"{where}: {error.str()}")
                            continue  # the end of what the partition holds now: more may come
                        expected = start + len(values)
                        if message.offset() < expected:
                            continue  # before the range (a seek that landed earlier)
                        if message.offset() > expected:
                            raise DataError(
                                f"{where}: offset {expected} is missing (the next is {message.offset()}): the "
                                "broker no longer holds it (retention), or the topic is compacted or "
                                "transactional, which stream training does not read yet"
                            )
                        if message.offset() < end:
                            values.append(message.value() or b"")
            finally:
                consumer.unassign()
            return values

    def timestamps(self, offsets: Mapping[int, int], timeout: float = CHECK_TIMEOUT_SECS) -> dict[int, float]:
        """The Kafka timestamp (epoch seconds) of the record at ``offsets[partition]`` of each
        partition; a partition whose record does not arrive within ``timeout``, or has no
        timestamp, is left out."""
        if self._helper is not None:
            return self._helper.call(_timestamps_there, self.address, dict(offsets), timeout)
        kafka = _client_module()
        if not offsets:
            return {}
        with _fetching(self.address.brokers, self.keep_consumers) as consumer:
            consumer.assign([kafka.TopicPartition(self.address.topic, p, o) for p, o in offsets.items()])
            found: dict[int, float] = {}
            try:
                deadline = time.monotonic() + timeout
                while len(found) < len(offsets) and (left := deadline - time.monotonic()) > 0:
                    for message in consumer.consume(num_messages=len(offsets), timeout=min(left, CONSUME_SECS)):
                        partition = message.partition()
                        if message.error() is not None or message.offset() != offsets.get(partition):
                            continue
                        kind, millis = message.timestamp()
                        if kind != kafka.TIMESTAMP_NOT_AVAILABLE:
                            found[partition] = millis / 1000.0
            finally:
                consumer.unassign()
            return found

    def sample(self, n: int, timeout: float = CHECK_TIMEOUT_SECS) -> list[bytes]:
        """Up to ``n`` records from the start of the first partition that holds any (the submit
        check's batch)."""
        for partition in self.partitions(timeout=timeout):
            low, _high = self.watermarks(partition, timeout)
            found = self.probe({partition: low}, n, wait=min(timeout, 2.0))
            if found[partition] > low:
                return self.read(partition, low, min(found[partition], low + n), timeout)
        return []


class FetchHelper:
    """A process of its own that fetches records for the caller (one call at a time), made again
    after it dies. Tansu 0.6.0 plus librdkafka crash a process whose consumer is fetching when
    a topic is deleted (SIGSEGV in librdkafka's metadata cache, see ``_fetching``): in the helper
    that is a failed call (a DataError), not the master's death."""

    def __init__(self):
        self._pool = None
        self._lock = threading.Lock()

    def call(self, fn, *args):
        from concurrent.futures.process import BrokenProcessPool

        with self._lock:
            if self._pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                # spawn: a fork of a process with gRPC's and librdkafka's threads is not safe
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_die_with, initargs=(os.getpid(),))
            pool = self._pool
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None  # the next call starts a new helper
            pool.shutdown(wait=False)
            raise DataError("the process fetching Kafka records for the master died (was the topic "
                            "deleted?)") from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _die_with(parent: int) -> None:
    """The helper goes when its parent does, even on SIGKILL: an orphan would hold the parent's
    stdout and stderr open (a caller waiting for their end would wait for ever)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux
    if os.getppid() != parent:  # it died before the request
        os._exit(1)


def _probe_there(address: KafkaAddress, starts: dict[int, int], limit: int, wait: float) -> dict[int, int]:
    return KafkaTopic(address).probe(starts, limit, wait)


def _timestamps_there(address: KafkaAddress, offsets: dict[int, int], timeout: float) -> dict[int, float]:
    return KafkaTopic(address).timestamps(offsets, timeout)


def read_partition_range(path: str, start: int, end: int) -> list[bytes]:
    """A stream task's records: offsets ``start`` .. ``end - 1`` of the partition ``path`` names."""
    address, partition = parse_partition_path(path)
    return KafkaTopic(address).read(partition, start, end)


class GroupOffsets:
    """A consumer group's committed offsets of one topic (``--kafka_group``): what standard lag
    monitors read. Only written, never read back by the job: the master's ledger holds the truth.
    Its own consumer (never subscribed: no group rebalance, no fetch), safe to call from any
    thread, one call at a time."""

    def __init__(self, address: KafkaAddress, group: str):
        kafka = _client_module()
        self.address = address
        self.group = group
        self._lock = threading.Lock()
        self._consumer = kafka.Consumer({
            "bootstrap.servers": address.brokers,
            "group.id": group,
            "enable.auto.commit": False,
            "allow.auto.create.topics": False,
            "log_level": 0,
        })

    def commit(self, offsets: Mapping[int, int]) -> None:
        """Commit ``offsets`` (partition -> the next offset to consume); a DataError if the broker
        refuses or cannot be reached."""
        kafka = _client_module()
        if not offsets:
            return
        parts = [kafka.TopicPartition(self.address.topic, p, o) for p, o in sorted(offsets.items())]
        with self._lock:
            try:
                answered = self._consumer.commit(offsets=parts, asynchronous=False)
            except kafka.KafkaException as err:
                raise DataError(f"committing offsets of group {self.group!r} to {self.address.brokers}: "
                                f"{err.args[0].str() if err.args else err}") from None
        failed = [f"{p.partition}: {p.error.str()}" for p in answered or () if p.error is not None]
        if failed:
            raise DataError(f"committing offsets of group {self.group!r}: {'; '.join(failed)}")

    def committed(self, partitions: list[int], timeout: float = CHECK_TIMEOUT_SECS) -> dict[int, int]:
        """The group's committed offset of each partition (negative: none committed)."""
        kafka = _client_module()
        with self._lock:
            found = self._consumer.committed([kafka.TopicPartition(self.address.topic, p) for p in partitions],
                                             timeout=timeout)
        return {p.partition: p.offset for p in found}

    def close(self) -> None:
        with self._lock:
            self._consumer.close()
