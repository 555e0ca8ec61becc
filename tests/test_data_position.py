"""Exactly once, driven step by step: the PS's data position, fences, rollbacks to a cut, and
the ledger taking tasks back from the PS's marks. No processes: the cores directly."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.data.sources import Shard
from elasticdl.master.task_manager import NoTask, TaskManager
from elasticdl.model import checkpoint
from elasticdl.ps.server import StaleTermError
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.store.ledger import TaskState
from tests.test_ps_server import grads, make_ps, model


def push(ps, task_id, handout, end, records=10, version=None):
    return ps.push_gradients(grads(), ps.shard.version if version is None else version, None,
                             batch=BatchPosition(task_id, handout, end, records))


# ---------------------------------------------------------------- the PS


def test_applied_marks_follow_versions_in_sync_mode():
    ps = make_ps(params=model(), grads_to_wait=2)
    assert push(ps, 3, 1, 10).outcome is PushOutcome.ACCEPTED_PENDING
    assert ps.position.marks == {} and ps.position.accepted_mark(3) == 10  # pending: taken, not applied
    assert push(ps, 4, 2, 110, version=0).outcome is PushOutcome.APPLIED
    assert ps.position.marks == {3: 10, 4: 110} and ps.position.records_applied == 20


def test_a_retried_push_is_not_applied_twice():
    ps = make_ps(params=model())
    assert push(ps, 1, 1, 10).applied
    before = ps.shard.params["dense/bias"].copy()
    answer = push(ps, 1, 1, 10)  # its answer was lost; the worker pushes the same batch again
    assert answer.applied and answer.reason == "already applied"
    np.testing.assert_array_equal(ps.shard.params["dense/bias"], before)
    assert ps.shard.version == 1 and ps.position.records_applied == 10


def test_a_fenced_hand_out_is_refused_and_changes_nothing():
    ps = make_ps(params=model())
    assert push(ps, 1, 5, 10).applied
    assert ps.fence([5], [1], term=0) == {1: 10}
    answer = push(ps, 1, 5, 20)
    assert answer.outcome is PushOutcome.REJECTED_FENCED and "taken back" in answer.reason
    assert ps.shard.version == 1 and ps.position.marks == {1: 10}
    assert push(ps, 1, 6, 20).applied  # the new hand-out of the same task goes on from the mark


def test_a_negative_batch_position_is_refused():
    ps = make_ps(params=model())
    answer = ps.push_gradients(grads(), 0, None, batch=BatchPosition(1, 1, 5, 10))
    assert answer.outcome is PushOutcome.REJECTED_INVALID and ps.shard.version == 0


def test_the_checkpoint_holds_the_data_position_and_a_rollback_restores_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ps = make_ps(params=model(), checkpoint_dir=ckpt, checkpoint_steps=2, term=7)
    for end in (10, 20, 30):
        assert push(ps, 1, 1, end).applied
    assert checkpoint.complete_versions(ckpt) == [2]
    assert checkpoint.cut_position(ckpt) == (2, {1: 20}, [20])
    saved = ps.shard.params["dense/bias"].copy()
    version = ps.roll_back(checkpoint.resolve_checkpoint(ckpt), term=7, fence_floor=2)
    assert version == 2 and ps.shard.version == 2 and ps.position.marks == {1: 20}
    assert ps.position.records_applied == 20
    assert not np.array_equal(ps.shard.params["dense/bias"], saved)  # version 3's update is gone
    assert push(ps, 1, 1, 30).outcome is PushOutcome.REJECTED_FENCED  # the old hand-out
    assert push(ps, 1, 2, 30).applied and ps.position.records_applied == 30


def test_a_rollback_outside_the_checkpoint_dir_is_refused(tmp_path):
    ps = make_ps(params=model(), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_steps=1)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint under"):
        ps.roll_back("/etc", term=0, fence_floor=0)
    assert ps.shard.version == 0


def test_a_rollback_names_a_cut_under_the_checkpoint_dir_local_or_remote():
    from elasticdl.ps.server import _under

    assert _under("/ckpt/version-4", "/ckpt") and not _under("/ckpt/../etc", "/ckpt")
    assert _under("s3://bucket/ckpt/version-4", "s3://bucket/ckpt/")
    assert not _under("s3://bucket/ckpt/../other/version-4", "s3://bucket/ckpt")
    assert not _under("s3://bucket/ckpt2/version-4", "s3://bucket/ckpt")
    assert not _under("/anything", "")


def test_commands_of_an_older_term_are_refused(tmp_path):
    ps = make_ps(params=model(), checkpoint_dir=str(tmp_path / "ckpt"), term=3)
    for command in (lambda: ps.fence([1], [], term=2), lambda: ps.set_learning_rate(0.5, term=2),
                    lambda: ps.checkpoint_at(5, term=2)):
        with pytest.raises(StaleTermError, match="term 2 refused"):
            command()
    ps.fence([], [], term=4)  # a newer term is adopted
    assert ps.term == 4
    with pytest.raises(StaleTermError):
        ps.fence([], [], term=3)


def test_a_cut_asked_at_a_version_is_saved_there(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ps = make_ps(params=model(), checkpoint_dir=ckpt)
    assert ps.checkpoint_at(2, term=0) == ""  # armed
    push(ps, 1, 1, 10)
    assert checkpoint.complete_versions(ckpt) == []
    push(ps, 1, 1, 20)
    assert checkpoint.complete_versions(ckpt) == [2]
    with pytest.raises(checkpoint.CheckpointError, match="at 2 already"):
        ps.checkpoint_at(1, term=0)


# ---------------------------------------------------------------- checkpoints


def _shard(version, term, marks):
    return checkpoint.ShardState(version, version, {"v": np.zeros(2, np.float32)}, {}, marks=marks,
                                 records_applied=sum(marks.values()), term=term)


def test_two_terms_never_make_one_cut(tmp_path):
    ckpt = str(tmp_path)
    checkpoint.save_shard(ckpt, 0, 2, _shard(40, 1, {1: 10}))  # the old master's PS 0
    checkpoint.save_shard(ckpt, 1, 2, _shard(40, 2, {1: 10}))  # the new master's PS 1
    assert checkpoint.complete_versions(ckpt) == []
    checkpoint.save_shard(ckpt, 0, 2, _shard(40, 2, {1: 10}))
    assert checkpoint.complete_versions(ckpt) == [40]
    # The newest term's lineage is the latest, whatever the versions of an older one.
    checkpoint.save_shard(ckpt, 0, 1, _shard(80, 1, {1: 20}))
    assert checkpoint.resolve_checkpoint(ckpt).endswith("version-40")


def test_a_cut_position_is_each_tasks_lowest_mark(tmp_path):
    checkpoint.save_shard(str(tmp_path), 0, 2, _shard(4, 1, {1: 30, 2: 10}))
    checkpoint.save_shard(str(tmp_path), 1, 2, _shard(4, 1, {1: 20}))
    assert checkpoint.cut_position(str(tmp_path)) == (4, {1: 20}, [40, 20])


def test_discard_after_removes_only_this_ps_abandoned_files(tmp_path):
    for version in (2, 4):
        for ps_id in (0, 1):
            checkpoint.save_shard(str(tmp_path), ps_id, 2, _shard(version, 1, {}))
    removed = checkpoint.discard_after(str(tmp_path), 2, 0, term=1)
    assert [p.rsplit("/", 2)[-2:] for p in removed] == [["version-4", "ps-0-of-2.term-1.npz"]]
    assert checkpoint.complete_versions(str(tmp_path)) == [2]


# ---------------------------------------------------------------- the ledger


def ledger(**kwargs) -> TaskManager:
    return TaskManager([Shard("f", 0, 100), Shard("f", 100, 200)], shuffle=False, fences_pushes=True, **kwargs)


def fence(tm: TaskManager, fencer) -> None:
    """Play the controller and the job: fence what the ledger took back, answer with the marks."""
    handouts, task_ids = tm.pending_fences()
    if handouts:
        tm.fenced(handouts, fencer(handouts, task_ids))


def test_a_dead_workers_task_goes_back_from_the_ps_marks():
    fenced = []

    def fencer(handouts, task_ids):
        fenced.append(handouts)
        return {task_ids[0]: 60}

    tm = ledger()
    task = tm.get_task(1)
    assert tm.progress(task.task_id, 1, 40).accepted  # the last progress report lagged behind the PS
    tm.recover_worker_tasks(1)
    assert tm.get_task(2).task_id != task.task_id  # not back before its hand-out is fenced
    assert not tm.between_epochs and not tm.finished
    fence(tm, fencer)
    assert fenced == [[task.handout]]
    assert tm.pending_fences() == ([], [])  # asked once
    again = tm.get_task(2)
    assert (again.task_id, again.shard.start, again.shard.end, again.origin) == (task.task_id, 60, 100, 0)
    assert again.handout > task.handout
    assert tm.epochs[0].records_trained_twice == 0 and tm.epochs[0].records_done == 60
    assert tm.report(again.task_id, 2, handout=again.handout).accepted
    assert tm.epochs[0].records_done == 100


def test_a_fully_applied_task_of_a_dead_worker_is_done():
    tm = ledger()
    task = tm.get_task(1)
    tm.recover_worker_tasks(1)
    fence(tm, lambda handouts, task_ids: {task_ids[0]: 100})
    assert tm.epochs[0].tasks_done == 1 and tm.epochs[0].records_done == 100
    assert tm.get_task(2).task_id != task.task_id


def test_without_marks_the_whole_attempt_is_trained_again():
    tm = ledger()
    task = tm.get_task(1)
    tm.progress(task.task_id, 1, 30)
    tm.recover_worker_tasks(1)
    fence(tm, lambda handouts, task_ids: None)  # a PS could not be asked
    assert tm.epochs[0].retrained == {"worker died": 30}
    assert tm.get_task(2).shard.start == 0


def test_a_report_of_a_taken_back_hand_out_is_refused():
    tm = ledger()
    task = tm.get_task(1)
    tm.rewind({}, cause="rollback")
    again = tm.get_task(1)  # the same worker gets the same task again
    assert not tm.report(task.task_id, 1, handout=task.handout).accepted
    assert tm.report(again.task_id, 1, handout=again.handout).accepted


def test_rewind_puts_every_record_after_the_cut_back_to_todo():
    tm = ledger()
    first = tm.get_task(1)
    assert tm.report(first.task_id, 1).accepted  # done: 0-100
    second = tm.get_task(1)
    tm.progress(second.task_id, 1, 50)  # doing: 100-150 trained
    again = tm.rewind({first.task_id: 64, second.task_id: 132})
    assert again == (100 - 64) + (150 - 132)
    assert tm.epochs[0].retrained == {"rollback": again}
    assert tm.epochs[0].records_done == 64 + 32 and tm.epochs[0].tasks_done == 0
    starts = []
    while (task := tm.get_task(2)) is not NoTask.END and not isinstance(task, NoTask):
        starts.append((task.task_id, task.shard.start, task.shard.end))
        assert tm.report(task.task_id, 2, handout=task.handout).accepted
    assert starts == [(first.task_id, 64, 100), (second.task_id, 132, 200)]
    assert tm.epochs[0].records_done == 200 and tm.epochs[0].tasks_done == 2


def test_rewind_reaches_into_the_previous_epoch():
    tm = TaskManager([Shard("f", 0, 100)], num_epochs=2, shuffle=False)
    a = tm.get_task(1)
    tm.report(a.task_id, 1)
    b = tm.get_task(1)  # epoch 2 starts
    assert b.epoch == 1
    tm.rewind({a.task_id: 40})  # the cut is in epoch 1
    got = tm.get_task(1)
    assert (got.task_id, got.epoch, got.shard.start) == (a.task_id, 0, 40)
    assert tm.epochs[0].records_done == 40 and tm.epochs[1].records_done == 0


def test_hand_outs_of_a_new_term_are_above_every_older_one():
    tm = ledger()
    old = tm.get_task(1).handout
    tm.start_term(3)
    assert tm.get_task(1).handout > max(old, 3 << 32)


def test_the_ledger_snapshot_keeps_done_tasks_and_origins():
    tm = ledger()
    done = tm.get_task(1)
    tm.report(done.task_id, 1)
    tm.get_task(1)
    tm.recover_worker_tasks(1)
    fence(tm, lambda handouts, task_ids: {task_ids[0]: 130})
    resumed = ledger()
    resumed.restore(tm.snapshot())
    assert set(resumed._done) == {done.task_id}
    again = resumed.get_task(1)
    assert (again.shard.start, again.origin) == (130, 100)
    resumed.rewind({})
    assert resumed.get_task(1).shard.start == 0  # back to the origin of each task


def test_a_fence_answer_after_a_rollback_is_ignored_and_a_taken_back_task_is_saved_as_in_flight():
    tm = ledger()
    task = tm.get_task(1)
    tm.recover_worker_tasks(1)
    saved = {r.task_id: r.state for r in tm.snapshot().tasks}
    assert saved[task.task_id] is TaskState.DOING  # a resumed master requeues it
    handouts, _ = tm.pending_fences()
    tm.rewind({}, cause="rollback")  # every hand-out fenced by the rollback itself
    tm.fenced(handouts, {task.task_id: 100})  # the late answer of the fence
    again = tm.get_task(2)
    assert (again.task_id, again.shard.start) == (task.task_id, 0)
    assert tm.epochs[0].records_done == 0
