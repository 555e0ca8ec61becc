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
