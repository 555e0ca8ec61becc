"""A stream task is handed out only once the state store holds it (issue 27).

The simulator found it (``--mode stream``, seed 2210; tests/test_simulator_stream.py): a master
whose ledger writes failed went on cutting new records into tasks and handing them out; the
master that replaced it resumed the older stored ledger and cut the same offsets again, and
their records were trained twice. Pure: the ledger and the source's ``feed``, no broker.
"""

from __future__ import annotations

from elasticdl.data.kafka_client import KafkaTopic
from elasticdl.data.sources import Shard
from elasticdl.master.stream_source import KafkaStreamSource
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.tasks import NoTask, Task
from elasticdl.store.ledger import LedgerSnapshot, TaskState

P0, P1 = "kafka://b:9092/t#0", "kafka://b:9092/t#1"


def _handed_out(ledger: StreamTaskManager, worker_id: int = 0) -> list[Task]:
    tasks = []
    while isinstance(task := ledger.get_task(worker_id), Task):
        tasks.append(task)
    return tasks


def test_a_new_stream_task_is_handed_out_only_once_the_store_holds_it():
    ledger = StreamTaskManager(hold_until_stored=True)
    ledger.add([Shard(P0, 0, 10), Shard(P1, 0, 4)])
    cut_at = ledger.seq
    assert ledger.get_task(0) is NoTask.WAIT and ledger.held == 2
    # Held tasks are cut: in the snapshot the master writes (as todo), in the offsets, not consumed.
    snapshot = LedgerSnapshot.from_bytes(ledger.snapshot().to_bytes())
    assert [(t.path, t.start, t.end) for t in snapshot.in_state(TaskState.TODO)] == [(P0, 0, 10), (P1, 0, 4)]
    assert ledger.offsets() == {P0: 10, P1: 4} and ledger.consumed() == {P0: 0, P1: 0}
    assert ledger.stored(cut_at - 1) == 0 and ledger.get_task(0) is NoTask.WAIT  # an older write
    assert ledger.stored(cut_at) == 2 and ledger.seq == cut_at + 1  # moved: parked requests look again
    assert [t.shard for t in _handed_out(ledger)] == [Shard(P0, 0, 10), Shard(P1, 0, 4)]
    assert ledger.held == 0 and ledger.stored(ledger.seq) == 0


def test_a_closed_stream_waits_for_its_held_tasks_and_a_stop_drops_them():
    ledger = StreamTaskManager(hold_until_stored=True)
    ledger.add([Shard(P0, 0, 10)])
    ledger.close_stream("idle")
    assert ledger.get_task(0) is NoTask.WAIT  # not END: the task is cut, the store does not hold it yet
    assert not ledger.finished and not ledger.between_epochs
    ledger.stored(ledger.seq)
    task = ledger.get_task(0)
    assert ledger.report(task.task_id, 0).accepted and ledger.finished

    ledger = StreamTaskManager(hold_until_stored=True)
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    assert ledger.stop() == 2 and ledger.held == 0 and ledger.finished
    assert ledger.get_task(0) is NoTask.END


def test_a_master_whose_writes_fail_hands_out_nothing_its_successor_cuts_again():
    old = StreamTaskManager(hold_until_stored=True)
    old.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    in_store = old.snapshot()  # the last write that reached the store
    old.stored(in_store.seq)
    trained = _handed_out(old)
    for task in trained:
        old.report(task.task_id, 0)
    old.add([Shard(P1, 0, 4), Shard(P0, 20, 30)])  # cut while every write fails (the store is cut off)
    assert _handed_out(old) == [] and old.held == 2  # before the fix: handed out, trained, in the PS's cut
    marks = {t.task_id: t.shard.end for t in trained}  # the PS's cut: what the old master's workers applied

    new = StreamTaskManager(hold_until_stored=True)
    new.restore(in_store)
    assert new.offsets() == {P0: 20}  # it cuts P1 and P0 20-30 again: nobody trained them
    new.rewind(marks, "master restart")
    new.add([Shard(P0, 20, 30), Shard(P1, 0, 4)])  # other ids for the same offsets: no mark names them
    new.stored(new.seq)
    again = _handed_out(new, 1)
    assert sorted((t.shard.path, t.shard.start, t.shard.end) for t in again) == [(P0, 20, 30), (P1, 0, 4)]
    assert new.epochs[0].records_done == 20 and new.epochs[0].records_trained_twice == 0


def test_the_rest_of_a_task_a_worker_left_gets_a_new_id_and_is_held_too():
    ledger = StreamTaskManager(hold_until_stored=True)
    ledger.add([Shard(P0, 0, 10)])
    ledger.stored(ledger.seq)
    task = ledger.get_task(0)
    assert ledger.report(task.task_id, 0, records=4, interrupted=True).accepted
    assert ledger.get_task(1) is NoTask.WAIT and ledger.held == 1
    ledger.stored(ledger.seq)
    rest = ledger.get_task(1)
    assert rest.shard == Shard(P0, 4, 10) and rest.task_id != task.task_id


def test_a_resumed_ledger_hands_out_what_it_restored_at_once():
    old = StreamTaskManager(hold_until_stored=True)
    old.add([Shard(P0, 0, 10)])  # held: in the snapshot as todo
    new = StreamTaskManager(hold_until_stored=True)
    new.restore(old.snapshot())
    assert new.get_task(0).shard == Shard(P0, 0, 10)  # it came from the store


def test_the_source_releases_what_the_store_holds_at_each_feed():
    stored = [-1]
    source = KafkaStreamSource(KafkaTopic.of("kafka://b:9092/t"), [0, 1], 10, 5.0, stored_seq=lambda: stored[0])
    ledger = StreamTaskManager(hold_until_stored=True)
    ledger.add([Shard(P0, 0, 10)])
    source.feed(ledger)
    assert ledger.get_task(0) is NoTask.WAIT
    stored[0] = ledger.seq  # the ledger writer wrote it since
    source.feed(ledger)
    assert ledger.get_task(0).shard == Shard(P0, 0, 10)
