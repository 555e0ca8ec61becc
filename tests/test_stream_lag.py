"""The consumer lag of a stream job while it runs (issue 27): per partition, the records behind its
end (seen: the watermark, or past it) minus the ledger's consumed offset (the first not done),
in the progress line, TensorBoard's scalars and the report. Pure: no broker is called."""

from __future__ import annotations

import io

from elasticdl.data.kafka_client import KafkaTopic
from elasticdl.data.sources import Shard
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.stream_source import LAG_SECS, KafkaStreamSource
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.tasks import Task

P0, P1 = "kafka://b:9092/t#0", "kafka://b:9092/t#1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _source(clock: Clock, starts: dict[int, int]) -> KafkaStreamSource:
    source = KafkaStreamSource(KafkaTopic.of("kafka://b:9092/t"), [0, 1], 10, 0.0, clock=clock)
    source.open({f"kafka://b:9092/t#{p}": o for p, o in starts.items()}, watch=False)  # the ledger's: no broker
    return source


def test_the_lag_is_what_each_partition_holds_past_what_the_ledger_consumed_and_falls_as_tasks_are_done():
    clock = Clock()
    source = _source(clock, {0: 0, 1: 5})
    ledger = StreamTaskManager()
    # Seen: 25 in partition 0 (0-9 and 10-19 cut, 20-24 lingering), nothing new in 1.
    ledger.add(source.cutter.observe({0: 25, 1: 5}, clock()))
    assert source.consumer_lag(ledger) == {0: 25, 1: 0}  # cut is not consumed: nothing is done
    first = ledger.get_task(0)
    ledger.report(first.task_id, 0)
    assert source.consumer_lag(ledger) == {0: 15, 1: 0}
    second = ledger.get_task(0)
    ledger.report(second.task_id, 0)
    source.cutter.observe({1: 9}, clock())  # partition 1 moved on: 4 records behind
    assert source.consumer_lag(ledger) == {0: 5, 1: 4}  # 20-24 lingers uncut: behind all the same


def test_feed_measures_the_lag_at_most_every_lag_secs_for_the_progress_line_and_tensorboard():
    clock = Clock()
    source = _source(clock, {0: 0, 1: 0})
    ledger = StreamTaskManager()
    assert source.total_lag is None and source.lag_scalars() == {}  # not measured yet
    source.cutter.observe({0: 30, 1: 10}, clock())
    source.feed(ledger)
    assert source.lag == {0: 30, 1: 10} and source.total_lag == 40
    ledger.add([Shard(P0, 0, 30)])
    while isinstance(task := ledger.get_task(0), Task):
        ledger.report(task.task_id, 0)
    source.feed(ledger)
    assert source.total_lag == 40  # measured a moment ago: the ledger is not walked at every feed
    clock.now += LAG_SECS
    source.feed(ledger)
    assert source.lag == {0: 0, 1: 10}
    assert source.lag_scalars() == {"stream/consumer_lag": 10, "stream/consumer_lag/partition_0": 0,
                                    "stream/consumer_lag/partition_1": 10}


def test_the_progress_line_shows_a_streams_lag_and_a_file_jobs_none():
    progress = TrainingProgress(1000, 1, stream=io.StringIO())
    assert "lag" not in progress.line(0, 100)
    progress.lag = 12345
    assert progress.line(0, 100).endswith("version 0  lag 12,345")
