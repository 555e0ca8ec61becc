"""The master's Kafka source against a real broker (tests/kafka_fixture.py), one poll at a time
on the test's own clock: what it cuts, where it starts, when it calls the stream idle."""

from __future__ import annotations

import pytest
from kafka_fixture import kafka_broker  # noqa: F401  (pytest finds fixtures by name)

from elasticdl.data.kafka_client import KafkaTopic
from elasticdl.errors import JobFailedError
from elasticdl.master.stream_cutter import LINGER_SECS
from elasticdl.master.stream_source import KafkaStreamSource
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.tasks import NoTask


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _source(broker, topic: str, clock: Clock, start: str = "earliest", idle: float = 5.0) -> KafkaStreamSource:
    kafka = KafkaTopic.of(f"kafka://{broker.bootstrap}/{topic}")
    return KafkaStreamSource(kafka, kafka.partitions(), records_per_task=100, idle_secs=idle, start=start,
                             clock=clock, timeout=1.0)


def _cut_all(source: KafkaStreamSource, ledger: StreamTaskManager, polls: int = 30) -> int:
    """Poll until a poll sees no new record, then once more after the linger (the records short
    of a whole task are cut then); the records added."""
    added = 0
    for _ in range(polls):
        seen = [source.cutter.seen_end(p) for p in source.partitions]
        source.poll_once()
        added += source.feed(ledger)
        if [source.cutter.seen_end(p) for p in source.partitions] == seen:
            source.clock.now += LINGER_SECS
            source.poll_once()
            return added + source.feed(ledger)
    raise AssertionError(f"still seeing new records after {polls} polls")


def test_every_record_is_cut_once_even_past_an_under_reported_watermark(kafka_broker):  # noqa: F811
    n = 5000
    kafka_broker.create_topic("batched", 1)
    kafka_broker.produce("batched", (b"%d" % i for i in range(n)))  # batched: Tansu's watermark lags
    clock = Clock()
    source = _source(kafka_broker, "batched", clock)
    assert source.open({}, watch=False) == {0: 0}
    ledger = StreamTaskManager()
    assert _cut_all(source, ledger) == n
    shards = [ledger.get_task(0).shard for _ in range(len(ledger._todo))]
    # Contiguous, each offset in one task, none over --records_per_task (a cut ends where the
    # partition's end was seen, so a task may be shorter).
    assert shards[0].start == 0 and shards[-1].end == n
    assert all(a.end == b.start for a, b in zip(shards, shards[1:]))
    assert all(s.records == 100 for s in shards)  # a remainder waits to fill a task: 5000 makes 50 whole ones
    # More records later: cut from where the cutting stood.
    kafka_broker.produce("batched", [b"late-1", b"late-2"])
    clock.now += 1
    assert _cut_all(source, ledger) == 2
    assert ledger.get_task(0).shard.start == n


def test_the_stream_closes_after_the_idle_time_without_a_new_record(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("quiet", 2)
    kafka_broker.produce("quiet", [b"a", b"b", b"c"], partitions=2)
    clock = Clock()
    source = _source(kafka_broker, "quiet", clock, idle=5.0)
    source.open({}, watch=False)
    ledger = StreamTaskManager()
    assert _cut_all(source, ledger) == 3
    clock.now = source.cutter.last_new + 4.9  # the last new record was seen then
    source.poll_once()
    source.feed(ledger)
    assert ledger.stream_open
    clock.now += 0.1
    source.poll_once()
    source.feed(ledger)
    assert not ledger.stream_open and "--stream_idle_secs" in ledger.close_reason


def test_a_resumed_source_goes_on_from_the_ledgers_offsets_and_latest_skips_the_backlog(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("resume", 2)
    kafka_broker.produce("resume", (b"%d" % i for i in range(400)), partitions=2)  # 200 per partition
    clock = Clock()
    source = _source(kafka_broker, "resume", clock)
    path0 = source.topic.address.partition_path(0)
    assert source.open({path0: 150}, watch=False) == {0: 150, 1: 0}  # partition 1: never cut, from earliest
    ledger = StreamTaskManager()
    assert _cut_all(source, ledger) == 50 + 200
    latest = _source(kafka_broker, "resume", clock, start="latest")
    assert latest.open({}, watch=False) == {0: 200, 1: 200}  # past the records held at the start
    kafka_broker.produce("resume", [b"new"] * 4, partitions=2)
    fresh = StreamTaskManager()
    assert _cut_all(latest, fresh) == 4


def test_a_broker_outage_is_waited_out_and_not_counted_as_idle(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("outage", 1)
    kafka_broker.produce("outage", [b"a"])
    clock = Clock()
    source = _source(kafka_broker, "outage", clock, idle=5.0)
    source.open({}, watch=False)
    ledger = StreamTaskManager()
    assert _cut_all(source, ledger) == 1
    kafka_broker.stop()
    clock.now += 60  # far past the idle time, all of it in the outage
    source.poll_once()
    source.feed(ledger)
    assert ledger.stream_open


def test_records_short_of_a_task_are_cut_before_the_stream_closes_idle(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("few", 1)
    kafka_broker.produce("few", [b"a", b"b", b"c"])
    clock = Clock()
    source = _source(kafka_broker, "few", clock, idle=5.0)
    source.open({}, watch=False)
    ledger = StreamTaskManager()
    for _ in range(10):  # until the three are seen (past the watermark); no time passes: they linger
        source.poll_once()
        if source.cutter.seen_end(0) == 3:
            break
    assert source.feed(ledger) == 0
    clock.now += 5.0
    source.poll_once()
    assert source.feed(ledger) == 3  # cut, then the stream closes
    assert not ledger.stream_open and ledger.records_per_epoch == 3


def test_the_summary_gives_each_partitions_start_cut_seen_and_lag(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("summary", 2)
    kafka_broker.produce("summary", (b"%d" % i for i in range(250)), partitions=2)  # 125 per partition
    clock = Clock()
    source = _source(kafka_broker, "summary", clock)
    source.open({source.topic.address.partition_path(1): 25}, watch=False)
    ledger = StreamTaskManager()
    for _ in range(10):  # seen to the ends; the 25-record remainders still wait (no time passed)
        source.poll_once()
        source.feed(ledger)
        if [source.cutter.seen_end(p) for p in (0, 1)] == [125, 125]:
            break
    summary = source.summary(ledger)  # lag: seen minus consumed (done): nothing is trained yet
    assert summary["partitions"] == {"0": {"start": 0, "cut_to": 100, "consumed": 0, "seen": 125, "lag": 125},
                                     "1": {"start": 25, "cut_to": 125, "consumed": 25, "seen": 125, "lag": 100}}
    assert summary["closed"] == "" and summary["records_cut"] == 200 and summary["lag"] == 225
    assert summary["url"] == f"kafka://{kafka_broker.bootstrap}/summary"
    # A stop drops the tasks not started: their records are lag, and the source stops cutting.
    ledger.stop()
    source.feed(ledger)
    assert source._stop.is_set()
    assert source.summary(ledger)["partitions"]["0"] == {"start": 0, "cut_to": 0, "consumed": 0, "seen": 125,
                                                         "lag": 125}


def test_kafka_group_commits_the_ledgers_consumed_offsets_to_the_broker(kafka_broker):  # noqa: F811
    from elasticdl.data.kafka_client import GroupOffsets
    from elasticdl.master.stream_source import COMMIT_SECS

    kafka_broker.create_topic("grouped", 2)
    kafka_broker.produce("grouped", (b"%d" % i for i in range(500)), partitions=2)  # 250 a partition
    clock = Clock()
    kafka = KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/grouped")
    group = GroupOffsets(kafka.address, "lag-monitored")
    source = KafkaStreamSource(kafka, kafka.partitions(), records_per_task=100, idle_secs=5.0, clock=clock,
                               timeout=1.0, group=group)
    source.open({}, watch=False)
    ledger = StreamTaskManager()
    assert _cut_all(source, ledger) == 500
    monitor = GroupOffsets(kafka.address, "lag-monitored")  # what a lag monitor reads
    tasks = {}
    while (task := ledger.get_task(len(tasks))) is not NoTask.WAIT:
        tasks[(task.shard.path[-1], task.shard.start)] = (task, len(tasks))

    def report(partition: str, start: int) -> None:
        task, worker = tasks[(partition, start)]
        assert ledger.report(task.task_id, worker).accepted

    def commit() -> dict[int, int]:
        clock.now += COMMIT_SECS
        source.feed(ledger)
        source.commit_consumed()  # the watching thread's call
        return monitor.committed([0, 1])

    assert commit() == {0: 0, 1: 0}  # nothing trained: the start of each partition
    report("0", 0), report("0", 200), report("1", 100)
    assert commit() == {0: 100, 1: 0}  # partition 0's 100-199 and partition 1's 0-99 are not done
    report("0", 100), report("1", 0)
    assert commit() == {0: 250, 1: 200}
    report("1", 200)
    clock.now += COMMIT_SECS / 2  # handed over at most once a COMMIT_SECS; the end commits at once
    source.feed(ledger)
    source.close()
    consumed = ledger.consumed()
    assert monitor.committed([0, 1]) == {0: 250, 1: 250} == {
        p: consumed[kafka.address.partition_path(p)] for p in (0, 1)}
    monitor.close()


def test_a_deleted_topic_stops_the_stream_and_the_process_that_probed_it_lives_on(kafka_broker):  # noqa: F811
    from confluent_kafka.admin import AdminClient

    kafka_broker.create_topic("doomed", 2)
    kafka_broker.produce("doomed", (b"%d" % i for i in range(300)), partitions=2)
    clock = Clock()
    # The master's topic: records are fetched in a helper process (a consumer of this process
    # fetching when the topic is deleted would take it down with SIGSEGV, on Tansu).
    kafka = KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/doomed", keep_consumers=False, fetch_elsewhere=True)
    source = KafkaStreamSource(kafka, kafka.partitions(), records_per_task=100, idle_secs=0.0, clock=clock,
                               timeout=1.0)
    source.open({}, watch=False)
    ledger = StreamTaskManager()
    assert _cut_all(source, ledger) == 300
    first = ledger.get_task(0)  # in progress when the topic goes
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})  # kept until its answer
    for future in admin.delete_topics(["doomed"]).values():
        future.result(timeout=20)
    source.poll_once()
    assert source.deleted == f"the topic 'doomed' was deleted from {kafka_broker.bootstrap} while the job ran"
    source.feed(ledger)
    assert not ledger.stream_open and ledger.close_reason == source.deleted
    # The task in progress fails (its records cannot be read): not tried again; the rest was dropped.
    assert ledger.report(first.task_id, 0, "DataError: unknown topic").accepted
    ledger.fenced(*ledger.pending_fences()[:1], {})
    assert ledger.get_task(0) is NoTask.END and ledger.finished
    assert ledger.epochs[0].dropped == [] and ledger.records_done == 0
    with pytest.raises(JobFailedError, match=r"'doomed' was deleted .* final checkpoint and export"):
        source.raise_if_deleted()
    source.close()
