"""A stream's PS marks stay bounded (issue 27): the PS drops the marks of the tasks the ledger
folded (done, held by the newest checkpoint cut), told by the master after each compaction
(ps/data_position.py ``compact``, StreamTaskManager.done_below). The cores directly, no process."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

from elasticdl.data.kafka_client import KafkaTopic
from elasticdl.data.sources import Shard
from elasticdl.master.stream_source import COMPACT_SECS, KafkaStreamSource
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.tasks import Task
from elasticdl.ps.data_position import DataPosition
from elasticdl.rpc import trust
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.ps_client import PSClient
from tests.test_data_position import push
from tests.test_ps_server import make_ps, model
from tests.test_replication import gradient, pair
from tests.test_replication import model as replication_model
from tests.test_trust import KEY, served_ps  # noqa: F401  (a PS behind real gRPC, holding the job key)

P0, P1 = "kafka://b:9092/t#0", "kafka://b:9092/t#1"


def _apply(position: DataPosition, task_id: int, handout: int, end: int, records: int) -> None:
    batch = BatchPosition(task_id, handout, end, records)
    assert not position.already_taken(batch)
    position.accepted(batch)
    position.version_made()


def test_marks_below_the_folded_tasks_go_and_a_late_push_of_one_is_taken_already():
    position = DataPosition(marks={3: 40, 4: 50, 7: 10, 9: 64})
    assert position.compact(7) == 2 and position.marks == {7: 10, 9: 64}
    assert position.already_taken(BatchPosition(4, 2, 64, 14))  # past its old mark: still never applied again
    assert not position.already_taken(BatchPosition(7, 5, 20, 10))
    assert position.compact(5) == 0 and position.done_below == 7  # a lower (older) floor changes nothing


def test_a_ps_fence_with_done_below_drops_the_marks():
    ps = make_ps(params=model())
    for task_id, end in ((1, 10), (2, 10), (5, 10)):
        assert push(ps, task_id, task_id, end).applied
    assert ps.fence([], [5], term=0, done_below=3) == {5: 10}
    assert ps.position.marks == {5: 10}
    answer = push(ps, 2, 2, 20)  # a late push of a folded task
    assert answer.applied and answer.reason == "already applied" and ps.position.records_applied == 30


def test_a_primary_forwards_done_below_and_its_backup_drops_the_same_marks():
    primary, backup, _ = pair(use_async=True)
    primary.push_model(replication_model(), 0, ["bn/moving_mean"])
    rng = np.random.default_rng(3)
    for task_id in (1, 2, 5):
        batch = BatchPosition(task_id, task_id, 10, 10)
        assert primary.push_gradients(gradient(rng), primary.shard.version, None, batch=batch, worker_id=0).applied
    primary.fence([], [], term=0, done_below=3)
    assert primary.position.marks == backup.position.marks == {5: 10} and backup.position.done_below == 3


def test_done_below_is_the_lowest_task_id_the_ledger_still_holds():
    ledger = StreamTaskManager(hold_until_stored=True)
    assert ledger.done_below() == 0
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20), Shard(P1, 0, 10)])
    assert ledger.done_below() == 0  # held: not handed out yet, but the ledger holds them
    ledger.stored(ledger.seq)
    tasks = [ledger.get_task(0) for _ in range(3)]
    for task in tasks[:2]:
        ledger.report(task.task_id, 0)
    assert ledger.done_below() == 0  # done, not folded: a rewind may ask for their marks
    assert ledger.compact({0: 10, 1: 20}) == 2
    assert ledger.done_below() == 2  # task 2 is in progress
    ledger.report(tasks[2].task_id, 0)
    ledger.compact({2: 10})
    assert ledger.done_below() == 3  # every task folded: the next id


def test_a_long_stream_keeps_the_ps_marks_bounded():
    ledger, position = StreamTaskManager(), DataPosition()
    largest = 0
    for n in range(1200):  # 1,200 tasks of 10 records, 2 partitions; a cut every 100 tasks
        ledger.add([Shard(P0 if n % 2 else P1, n // 2 * 10, n // 2 * 10 + 10)])
        task = ledger.get_task(0)
        _apply(position, task.task_id, task.handout, task.shard.end, 10)
        ledger.report(task.task_id, 0)
        if n % 100 == 99:
            cut = dict(position.marks)  # what the PS saved in the cut
            ledger.compact(cut)
            position.compact(ledger.done_below())
        largest = max(largest, len(position.marks))
    assert largest <= 100 and position.records_applied == 12_000  # without the compaction: 1,200 marks
    # A rollback to the newest cut: the folded tasks stay done, nothing is trained again.
    assert ledger.rewind(dict(position.marks)) == 0 and ledger.epochs[0].records_done == 12_000


def test_the_source_sends_the_floor_after_each_compaction_and_logs_a_ps_that_does_not_take_it(caplog):
    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    sent, clock = [], Clock()
    source = KafkaStreamSource(KafkaTopic.of("kafka://b:9092/t"), [0, 1], 10, 5.0, clock=clock,
                               compact_freely=True, forget_marks=sent.append)
    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    while isinstance(task := ledger.get_task(0), Task):
        ledger.report(task.task_id, 0)
    source.feed(ledger)
    source.forget_folded_marks()
    assert sent == []  # no compaction yet
    clock.now += COMPACT_SECS
    source.feed(ledger)
    source.forget_folded_marks()  # the watching thread's turn
    assert sent == [2]

    def away(floor: int) -> None:
        raise ConnectionError("ps-0 is restarting")

    source.forget_marks = away
    ledger.add([Shard(P0, 20, 30)])
    task = ledger.get_task(0)
    ledger.report(task.task_id, 0)
    clock.now += COMPACT_SECS
    source.feed(ledger)
    with caplog.at_level(logging.INFO, logger="elasticdl.master.stream_source"):
        source.forget_folded_marks()  # not raised: the next compaction sends it again
    assert "did not drop the marks of tasks below 3" in caplog.text


def test_the_master_sends_done_below_over_grpc_and_a_negative_one_is_refused(served_ps):  # noqa: F811
    ps, address = served_ps
    ps.position.marks = {1: 10, 2: 64, 5: 10}
    master = PSClient([address], master_credential=trust.master_credential(KEY))
    try:
        assert master.fence([], [], done_below=3) == [{}] and ps.position.marks == {5: 10}
        with pytest.raises(grpc.RpcError) as err:
            master.fence([], [], done_below=-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "done_below" in err.value.details()
    finally:
        master.close()
