"""The ledger of a stream job and its cutter: pure, driven directly with their own clock."""

from __future__ import annotations

import pytest

from elasticdl.data.sources import Shard
from elasticdl.master.stream_cutter import StreamCutter
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.tasks import NoTask

P0, P1 = "kafka://b:9092/t#0", "kafka://b:9092/t#1"


def _cutter(next_offsets=None, idle=5.0, per_task=10) -> StreamCutter:
    return StreamCutter(dict(next_offsets or {0: 0, 1: 0}), lambda p: f"kafka://b:9092/t#{p}", per_task, idle, 100.0)


def test_the_cutter_cuts_whole_tasks_at_once_and_a_remainder_after_its_linger():
    cutter = _cutter()  # 10 offsets a task, a remainder waits 1 s
    assert cutter.observe({0: 25, 1: 0}, 101.0) == [Shard(P0, 0, 10), Shard(P0, 10, 20)]
    assert cutter.observe({0: 25, 1: 3}, 101.5) == []  # P0's 20-24 and P1's 0-2 wait for more
    assert cutter.observe({0: 25, 1: 3}, 102.0) == [Shard(P0, 20, 25)]  # lingered 1 s since 101.0
    assert cutter.observe({0: 25, 1: 3}, 102.5) == [Shard(P1, 0, 3)]
    assert cutter.observe({0: 20, 1: 3}, 103.0) == []  # an end that went back (an old watermark) cuts nothing
    assert cutter.observe({0: 31}, 103.2) == []  # 6 short of a task: they wait
    assert cutter.observe({0: 36}, 103.4) == [Shard(P0, 25, 35)]  # filled: cut at once
    assert cutter.seen_end(0) == 36 and cutter.next_offsets[0] == 35


def test_the_cutter_is_idle_after_its_time_without_a_new_record_and_flushes_what_lingers():
    cutter = _cutter(idle=5.0)
    assert cutter.observe({0: 4}, 101.0) == []
    assert not cutter.idle(105.9)
    assert cutter.idle(106.0)
    assert cutter.flush(106.0) == [Shard(P0, 0, 4)]
    assert cutter.flush(106.0) == []
    cutter.observe({0: 5}, 108.0)  # a new record: idle counts again from here
    assert not cutter.idle(112.9) and cutter.idle(113.0)
    assert not _cutter(idle=0.0).idle(10_000.0)  # 0: never idle
    with pytest.raises(ValueError, match="records_per_task"):
        _cutter(per_task=0)


def test_a_stream_ledger_waits_while_open_and_ends_once_closed_and_done():
    ledger = StreamTaskManager()
    assert ledger.get_task(0) is NoTask.WAIT  # empty and open: records may come
    assert not ledger.finished and not ledger.between_epochs
    assert ledger.add([Shard(P0, 0, 10), Shard(P1, 0, 4)]) == 2
    assert ledger.records_per_epoch == 14
    first = ledger.get_task(0)
    second = ledger.get_task(1)
    assert (first.shard, second.shard) == (Shard(P0, 0, 10), Shard(P1, 0, 4))  # in arrival order
    assert ledger.report(first.task_id, 0).accepted and ledger.report(second.task_id, 1).accepted
    # All done, the stream open: still no END, no epoch end.
    assert ledger.get_task(0) is NoTask.WAIT
    assert not ledger.finished and not ledger.between_epochs
    ledger.close_stream("idle")
    assert ledger.add([Shard(P0, 10, 20)]) == 0  # nothing is added once closed
    assert ledger.finished and ledger.get_task(0) is NoTask.END
    assert ledger.epochs[0].records_done == 14 == ledger.epochs[0].records_total


def test_closing_leaves_the_tasks_cut_to_finish():
    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    held = ledger.get_task(0)
    ledger.close_stream("idle")
    assert not ledger.finished
    rest = ledger.get_task(1)
    assert rest.shard == Shard(P0, 10, 20)
    ledger.report(held.task_id, 0)
    ledger.report(rest.task_id, 1)
    assert ledger.finished


def test_a_stop_closes_the_stream_and_drops_what_did_not_start():
    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    held = ledger.get_task(0)
    assert ledger.stop() == 1
    assert not ledger.stream_open and ledger.add([Shard(P0, 20, 30)]) == 0
    ledger.report(held.task_id, 0)
    assert ledger.finished


def test_offsets_are_where_each_partition_was_cut_to_and_survive_a_resume():
    ledger = StreamTaskManager(fences_pushes=True)
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20), Shard(P1, 0, 5)])
    done = ledger.get_task(0)
    ledger.report(done.task_id, 0)
    ledger.get_task(1)  # in flight when the master dies
    assert ledger.offsets() == {P0: 20, P1: 5}
    resumed = StreamTaskManager(fences_pushes=True)
    resumed.restore(ledger.snapshot())
    assert resumed.offsets() == {P0: 20, P1: 5}
    assert resumed.stream_open and resumed.records_per_epoch == 25
    todo = [resumed.get_task(0).shard, resumed.get_task(1).shard]
    assert sorted(todo, key=lambda s: (s.path, s.start)) == [Shard(P0, 10, 20), Shard(P1, 0, 5)]


def test_a_killed_workers_task_goes_back_from_the_ps_marks_in_offsets():
    """Fencing works on offsets as on record indices: only the offsets the PS did not apply go back."""
    ledger = StreamTaskManager(fences_pushes=True)
    ledger.add([Shard(P0, 100, 164)])
    task = ledger.get_task(0)
    ledger.recover_worker_tasks(0)
    handouts, task_ids = ledger.pending_fences()
    assert task_ids == [task.task_id]
    ledger.fenced(handouts, {task.task_id: 132})  # the PS applied offsets 100..131
    again = ledger.get_task(1)
    assert again.shard == Shard(P0, 132, 164)
    ledger.report(again.task_id, 1)
    ledger.close_stream("idle")
    assert ledger.finished and ledger.epochs[0].records_done == 64


def test_a_rollback_rewinds_offsets_to_the_cuts_marks():
    ledger = StreamTaskManager(fences_pushes=True)
    ledger.add([Shard(P0, 0, 10), Shard(P1, 0, 10)])
    a, b = ledger.get_task(0), ledger.get_task(1)
    ledger.report(a.task_id, 0)
    ledger.report(b.task_id, 1)
    again = ledger.rewind({a.task_id: 10, b.task_id: 4})  # the cut holds all of P0's task, 4 of P1's
    assert again == 6
    assert ledger.get_task(0).shard == Shard(P1, 4, 10)
    assert ledger.offsets() == {P0: 10, P1: 10}  # cutting goes on after the rewound range, not from it


def test_bad_records_of_a_stream_count_as_skipped_training_records():
    """A stream task's bad record names its partition (kafka://.../t#0) and its offset; the job's
    data is the stream's address. Counted as skipped (their batches were pushed), so that
    exactly_once compares the PS's count with the records done plus these."""
    from elasticdl.data.errors import BadRecord
    from elasticdl.master.cut_recovery import skipped_bad_records

    bad = [BadRecord(P0, 17, "not an Example"), BadRecord(P1, 3, "not an Example"),
           BadRecord("kafka://b:9092/other#0", 1, "another stream's"), BadRecord("data/a.tfrecord", 2, "a file's")]
    assert skipped_bad_records(bad, [("kafka://b:9092/t", 0)]) == 2
    assert skipped_bad_records(bad, [("data/a.tfrecord", 10)]) == 1


def test_consumed_offsets_stop_at_the_first_offset_not_done_and_go_back_with_a_rewind():
    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20), Shard(P0, 20, 30), Shard(P1, 0, 5)])
    assert ledger.consumed() == {P0: 0, P1: 0}  # nothing done
    held = {t.shard: (t, w) for w in range(4) for t in [ledger.get_task(w)]}  # read-ahead may reorder
    a, b, c, d = (held[s][0] for s in (Shard(P0, 0, 10), Shard(P0, 10, 20), Shard(P0, 20, 30), Shard(P1, 0, 5)))
    worker = {t.task_id: held[t.shard][1] for t in (a, b, c, d)}
    assert ledger.report(b.task_id, worker[b.task_id]).accepted and ledger.report(d.task_id, worker[d.task_id]).accepted
    assert ledger.consumed() == {P0: 0, P1: 5}  # P0's 10-19 are done, 0-9 not yet: a gap stops it
    assert ledger.report(a.task_id, worker[a.task_id]).accepted
    assert ledger.consumed() == {P0: 20, P1: 5}  # c is in progress
    ledger.report(c.task_id, worker[c.task_id], interrupted=True, records=4)  # its worker left after 4 records: 24-29 back to todo
    assert ledger.consumed() == {P0: 24, P1: 5}
    ledger.rewind({a.task_id: 6})  # a rollback to a cut that holds P0's 0-5 only (and nothing of P1)
    assert ledger.consumed() == {P0: 6, P1: 0}


def _train_all(ledger: StreamTaskManager) -> list:
    """Hand out and report every task in todo; the tasks done."""
    done = []
    while (task := ledger.get_task(0)) is not NoTask.WAIT:
        assert ledger.report(task.task_id, 0).accepted
        done.append(task)
    return done


def test_a_long_stream_keeps_a_bounded_ledger_once_cuts_hold_what_is_done():
    ledger = StreamTaskManager()
    marks: dict[int, int] = {}
    sizes = []
    for step in range(300):  # 300 rounds of 2 tasks a partition: 12,000 records
        ledger.add([Shard(p, 20 * step, 20 * step + 10) for p in (P0, P1)]
                   + [Shard(p, 20 * step + 10, 20 * step + 20) for p in (P0, P1)])
        for task in _train_all(ledger):
            marks[task.task_id] = task.shard.end
        if step % 10 == 9:  # a checkpoint cut every 10 rounds holds everything done so far
            ledger.compact(dict(marks))
        sizes.append(len(ledger.snapshot().tasks))
    assert max(sizes) <= 2 + 4 * 10  # a compacted task a partition, and the tasks since the last cut
    assert ledger.offsets() == ledger.consumed() == ledger.newest_done() == {P0: 6000, P1: 6000}
    assert ledger.records_done == 12_000


def test_compaction_waits_for_the_cut_and_stops_at_what_is_not_done():
    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20), Shard(P0, 20, 30), Shard(P0, 30, 40), Shard(P1, 0, 10)])
    done = {t.shard: t for t in _train_all(ledger)}
    ledger.add([Shard(P0, 40, 50)])  # in todo: compaction never passes it
    a, b, c = (done[Shard(P0, s, s + 10)] for s in (0, 10, 20))
    cut = {a.task_id: 10, b.task_id: 20, c.task_id: 25}  # the cut holds c's first half only
    assert ledger.compact(cut) == 2  # a and b; c is not whole in the cut; P1's task is in no cut
    assert sorted((t.shard.start, t.shard.end, t.task_id < 0) for t in ledger._done.values() if t.shard.path == P0) == [
        (0, 20, True), (20, 30, False), (30, 40, False)]
    assert ledger.compact(None) == 3  # without checkpoints: every done prefix (P0 up to its todo task, P1)
    assert ledger.offsets() == {P0: 50, P1: 10} and ledger.consumed() == {P0: 40, P1: 10}


def test_compacted_offsets_survive_a_resume_and_stay_done_in_a_rollback():
    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    first = _train_all(ledger)
    ledger.compact({t.task_id: t.shard.end for t in first})
    ledger.add([Shard(P0, 20, 30), Shard(P0, 30, 40)])
    later = _train_all(ledger)
    resumed = StreamTaskManager()
    resumed.restore(ledger.snapshot())
    assert resumed.offsets() == {P0: 40} and resumed.records_done == 40  # a resumed source goes on at 40
    # A PS died: back to a cut after the compaction that holds 20-29 and half of 30-39.
    again = resumed.rewind({later[0].task_id: 30, later[1].task_id: 35})
    assert again == 5 and resumed.records_done == 35
    assert [resumed.get_task(0).shard] == [Shard(P0, 35, 40)]  # only the rest: the compacted 0-19 stay done


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _source(cut_marks=None, compact_freely=False):
    from elasticdl.data.kafka_client import KafkaTopic
    from elasticdl.master.stream_source import KafkaStreamSource

    clock = _Clock()  # the source never calls the broker here: no open, no poll
    return KafkaStreamSource(KafkaTopic.of("kafka://b:9092/t"), [0, 1], 10, 5.0, clock=clock,
                             cut_marks=cut_marks, compact_freely=compact_freely), clock


def test_the_source_compacts_the_ledger_with_the_newest_cuts_marks_every_compact_secs():
    from elasticdl.master.stream_source import COMPACT_SECS

    ledger = StreamTaskManager()
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    first, second = _train_all(ledger)
    cuts = [None, {first.task_id: 10}]  # no cut yet, then one that holds the first task
    source, clock = _source(cut_marks=lambda: cuts.pop(0))
    source.look_for_cut()
    source.feed(ledger)
    assert len(ledger._done) == 2  # not before COMPACT_SECS
    for _ in range(2):
        clock.now += COMPACT_SECS
        source.look_for_cut()  # the watching thread's look
        source.feed(ledger)
    assert sorted((t.task_id < 0, t.shard.start, t.shard.end) for t in ledger._done.values()) == [
        (False, 10, 20), (True, 0, 10)]

    ledger = StreamTaskManager()  # no --checkpoint_dir: the done prefix is compacted as it is
    ledger.add([Shard(P0, 0, 10), Shard(P0, 10, 20)])
    _train_all(ledger)
    source, clock = _source()  # neither: never (the simulator's source: its job has checkpoints)
    clock.now += COMPACT_SECS
    source.feed(ledger)
    assert len(ledger._done) == 2
    source, clock = _source(compact_freely=True)
    clock.now += COMPACT_SECS
    source.feed(ledger)
    assert [(t.task_id < 0, t.shard.start, t.shard.end) for t in ledger._done.values()] == [(True, 0, 20)]


def test_the_newest_cut_marks_are_read_once_a_newer_cut_is_complete(tmp_path):
    import numpy as np

    from elasticdl.master.stream_source import NewestCutMarks
    from elasticdl.model import checkpoint

    def cut(version: int, marks: dict[int, int]) -> None:
        for ps in range(2):
            checkpoint.save_shard(str(tmp_path), ps, 2, checkpoint.ShardState(
                version, version, {f"v{ps}": np.zeros(1, np.float32)}, {}, marks=marks, records_applied=10))

    newest = NewestCutMarks(str(tmp_path))
    assert newest() is None
    cut(5, {1: 10})
    assert newest() == {1: 10}
    checkpoint.save_shard(str(tmp_path), 0, 2, checkpoint.ShardState(
        9, 9, {"v0": np.zeros(1, np.float32)}, {}, marks={1: 10, 2: 30}))  # one shard of two: not a cut yet
    assert newest() == {1: 10}
    cut(9, {1: 10, 2: 30})
    assert newest() == {1: 10, 2: 30}
