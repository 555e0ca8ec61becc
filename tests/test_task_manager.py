"""The master's task ledger, driven directly with a fake clock."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticdl.data.sources import Shard
from elasticdl.master.task_manager import NoTask, ReportOutcome, Task, TaskManager


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_shards(n: int, size: int = 10, files: int = 2) -> list[Shard]:
    """``n`` shards of ``size`` records spread over ``files`` files."""
    per_file = -(-n // files)
    return [
        Shard(f"data/f{i // per_file}.tfrecord", (i % per_file) * size, (i % per_file + 1) * size)
        for i in range(n)
    ]


def make_tm(shards=None, clock=None, **kwargs) -> TaskManager:
    return TaskManager(
        make_shards(6) if shards is None else shards,
        clock=clock or FakeClock(),
        **kwargs,
    )


def snapshot(tm: TaskManager):
    """Everything observable about the ledger, deep-copied."""
    return (
        tm.counts(),
        tm.epoch,
        [dataclasses.asdict(e) for e in tm.epochs],
        [dataclasses.asdict(t) for t in tm._todo],
        {k: (dataclasses.asdict(d.task), d.worker_id, d.started) for k, d in tm._doing.items()},
    )


def drain_order(tm: TaskManager, worker: int = 0) -> list[list[Shard]]:
    """Run the whole job with one always-successful worker; the shard order of each epoch."""
    order: dict[int, list[Shard]] = {}
    for _ in range(10_000):
        task = tm.get_task(worker)
        if task is NoTask.END:
            return [order[e] for e in sorted(order)]
        assert isinstance(task, Task), task
        order.setdefault(task.epoch, []).append(task.shard)
        assert tm.report(task.task_id, worker).accepted
    raise AssertionError("job did not end")


# ---------------------------------------------------------------- happy path


def test_every_record_of_every_epoch_handed_out_once():
    shards = make_shards(7, size=5)
    tm = make_tm(shards, num_epochs=3)
    order = drain_order(tm)
    assert len(order) == 3
    for epoch_shards in order:
        assert sorted(epoch_shards, key=lambda s: (s.path, s.start)) == sorted(
            shards, key=lambda s: (s.path, s.start)
        )
    assert tm.finished
    assert tm.counts() == (0, 0)
    assert [e.records_done for e in tm.epochs] == [35, 35, 35]
    assert [e.tasks_done for e in tm.epochs] == [7, 7, 7]
    assert all(e.records_total == 35 for e in tm.epochs)
    assert tm.dropped_tasks() == []
    # After END, it stays END.
    assert tm.get_task(1) is NoTask.END


def test_task_ids_are_unique_across_epochs():
    tm = make_tm(make_shards(4), num_epochs=2)
    ids = []
    while (task := tm.get_task(0)) is not NoTask.END:
        ids.append(task.task_id)
        tm.report(task.task_id, 0)
    assert len(ids) == 8 == len(set(ids))


def test_tasks_reshuffled_each_epoch_deterministically_per_seed():
    shards = make_shards(20)
    a = drain_order(make_tm(shards, num_epochs=3, seed=7))
    b = drain_order(make_tm(shards, num_epochs=3, seed=7))
    c = drain_order(make_tm(shards, num_epochs=3, seed=8))
    assert a == b  # same seed, same order
    assert a[0] != a[1] and a[1] != a[2]  # reshuffled per epoch
    assert a != c  # another seed, another order


def test_no_shuffle_keeps_file_order():
    shards = make_shards(6)
    order = drain_order(make_tm(shards, num_epochs=2, shuffle=False))
    assert order == [shards, shards]


def test_empty_shards_rejected():
    with pytest.raises(ValueError, match="no records"):
        TaskManager([])


def test_wait_while_others_hold_tasks_then_end():
    tm = make_tm(make_shards(2), num_epochs=2)
    t1, t2 = tm.get_task(0), tm.get_task(1)
    assert isinstance(t1, Task) and isinstance(t2, Task)
    assert tm.get_task(2) is NoTask.WAIT
    assert tm.report(t1.task_id, 0).accepted
    assert tm.get_task(2) is NoTask.WAIT  # t2 may still fail and come back
    assert tm.epoch == 0
    assert tm.report(t2.task_id, 1).accepted
    assert not tm.finished
    t3 = tm.get_task(2)  # epoch 1 starts
    assert isinstance(t3, Task) and t3.epoch == 1 and tm.epoch == 1
    t4 = tm.get_task(0)
    assert tm.get_task(1) is NoTask.WAIT
    tm.report(t3.task_id, 2)
    tm.report(t4.task_id, 0)
    assert tm.finished
    assert tm.get_task(1) is NoTask.END
    assert len(tm.epochs) == 2


# ---------------------------------------------------------------- faults


def test_timeout_requeues_with_retry_and_hands_to_another_worker():
    clock = FakeClock()
    tm = make_tm(make_shards(3), clock=clock, task_timeout=10.0, max_task_retries=3, shuffle=False)
    first = tm.get_task(1)
    clock.advance(10.0)
    assert tm.counts() == (2, 1)  # exactly the timeout: not late yet
    second = tm.get_task(2)
    assert second.task_id != first.task_id
    clock.advance(0.5)  # first is now 10.5 s old, second 0.5 s
    again = tm.get_task(3)
    assert again.task_id == first.task_id
    assert again.shard == first.shard and again.retries == 1
    assert tm.epochs[0].tasks_retried == 1
    # The slow worker's late report is refused; the new assignee's is taken.
    refused = tm.report(first.task_id, 1)
    assert refused == ReportOutcome(False, refused.reason) and "worker 3" in refused.reason
    assert tm.report(first.task_id, 3).accepted
    assert tm.report(second.task_id, 2).accepted
    assert tm.epochs[0].records_done == 20


def test_past_max_retries_task_is_dropped_and_listed():
    clock = FakeClock()
    tm = make_tm(make_shards(2), clock=clock, task_timeout=5.0, max_task_retries=1, shuffle=False)
    bad = tm.get_task(0)
    good = tm.get_task(1)
    tm.report(good.task_id, 1)
    clock.advance(6)
    retried = tm.get_task(2)
    assert retried.task_id == bad.task_id and retried.retries == 1
    clock.advance(6)
    assert tm.get_task(0) is NoTask.END  # dropped: nothing left, one epoch
    dropped = tm.dropped_tasks()
    assert [t.task_id for t in dropped] == [bad.task_id]
    assert dropped[0].retries == 2 and dropped[0].shard == bad.shard
    assert tm.epochs[0].records_done == good.records
    assert tm.epochs[0].tasks_retried == 1
    assert tm.finished


def test_zero_retries_drops_on_first_failure():
    tm = make_tm(make_shards(1), max_task_retries=0)
    task = tm.get_task(0)
    assert tm.report(task.task_id, 0, err_message="oom").accepted
    assert [t.task_id for t in tm.dropped_tasks()] == [task.task_id]
    assert tm.get_task(0) is NoTask.END


def test_failure_report_retries_the_task():
    tm = make_tm(make_shards(3), max_task_retries=2, shuffle=False)
    task = tm.get_task(0)
    outcome = tm.report(task.task_id, 0, err_message="boom")
    assert outcome.accepted
    assert tm.epochs[0].records_done == 0 and tm.epochs[0].tasks_done == 0
    assert tm.counts() == (3, 0)
    again = tm.get_task(1)  # back at the front of the queue
    assert again.task_id == task.task_id and again.retries == 1
    assert tm.report(again.task_id, 1, err_message="boom").accepted
    third = tm.get_task(0)
    assert third.task_id == task.task_id and third.retries == 2
    assert tm.report(third.task_id, 0, err_message="boom").accepted
    assert [t.task_id for t in tm.dropped_tasks()] == [task.task_id]
    assert tm.counts() == (2, 0)


def test_dead_worker_tasks_requeued_without_retry():
    tm = make_tm(make_shards(4), max_task_retries=0, shuffle=False)
    a, b = tm.get_task(7), tm.get_task(7)
    other = tm.get_task(8)
    recovered = tm.recover_worker_tasks(7)
    assert {t.task_id for t in recovered} == {a.task_id, b.task_id}
    assert tm.counts() == (3, 1)
    assert tm.recover_worker_tasks(7) == []
    got = [tm.get_task(9), tm.get_task(9)]
    assert {t.task_id for t in got} == {a.task_id, b.task_id}
    assert all(t.retries == 0 for t in got)  # max_task_retries=0 and still not dropped
    assert tm.dropped_tasks() == [] and tm.epochs[0].tasks_retried == 0
    # The dead worker's late report is refused.
    assert not tm.report(a.task_id, 7).accepted
    for t in got:
        assert tm.report(t.task_id, 9).accepted
    assert tm.report(other.task_id, 8).accepted


@pytest.mark.parametrize("kind", ["unknown", "duplicate", "foreign", "foreign_failure"])
def test_rejected_reports_change_nothing(kind):
    tm = make_tm(make_shards(3))
    task = tm.get_task(0)
    done = tm.get_task(1)
    assert tm.report(done.task_id, 1).accepted
    before = copy.deepcopy(snapshot(tm))
    if kind == "unknown":
        task_id, outcome = 12345, tm.report(12345, 0)
    elif kind == "duplicate":
        task_id, outcome = done.task_id, tm.report(done.task_id, 1)
    elif kind == "foreign":
        task_id, outcome = task.task_id, tm.report(task.task_id, 1)
    else:
        task_id, outcome = task.task_id, tm.report(task.task_id, 2, err_message="not mine")
    assert isinstance(outcome, ReportOutcome)
    assert outcome.accepted is False
    assert f"task {task_id} " in outcome.reason
    assert snapshot(tm) == before


def test_epoch_stats_records_done_uses_reported_count():
    tm = make_tm([Shard("a", 0, 10), Shard("b", 0, 4)], shuffle=False)
    t1, t2 = tm.get_task(0), tm.get_task(0)
    tm.report(t1.task_id, 0, records=7)  # the worker says how many it read
    tm.report(t2.task_id, 0)  # default: the shard size
    stats = tm.epochs[0]
    assert (stats.records_total, stats.records_done, stats.tasks_done) == (14, 11, 2)
    assert tm.records_per_epoch == 14


# ---------------------------------------------------------------- random interleavings

WORKERS = (0, 1, 2)

op = st.one_of(
    st.tuples(st.just("get"), st.sampled_from(WORKERS)),
    st.tuples(st.just("ok"), st.sampled_from(WORKERS), st.integers(0, 3)),
    st.tuples(st.just("fail"), st.sampled_from(WORKERS), st.integers(0, 3)),
    st.tuples(st.just("die"), st.sampled_from(WORKERS)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 6.0, 11.0])),
    st.tuples(st.just("stale"), st.sampled_from(WORKERS), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_shards=st.integers(1, 5),
    num_epochs=st.integers(1, 3),
    max_retries=st.integers(0, 2),
    ops=st.lists(op, max_size=80),
)
def test_random_interleavings_never_lose_a_shard(n_shards, num_epochs, max_retries, ops):
    clock = FakeClock()
    shards = make_shards(n_shards, size=3)
    tm = TaskManager(
        shards, num_epochs=num_epochs, task_timeout=10.0, max_task_retries=max_retries,
        seed=1, clock=clock,
    )
    held: dict[int, list[Task]] = {w: [] for w in WORKERS}  # what each worker believes it holds
    completed: list[tuple[int, Shard]] = []
    completed_ids: set[int] = set()
    ever_given: set[int] = set()

    def on_accepted_success(task: Task) -> None:
        assert task.task_id not in completed_ids, "a task completed twice"
        completed_ids.add(task.task_id)
        completed.append((task.epoch, task.shard))

    def give(worker: int) -> None:
        task = tm.get_task(worker)
        if isinstance(task, Task):
            assert task.task_id not in completed_ids, "a completed task was handed out again"
            ever_given.add(task.task_id)
            for tasks in held.values():  # it left whoever held it before (timeout)
                tasks[:] = [t for t in tasks if t.task_id != task.task_id]
            held[worker].append(task)
        elif task is NoTask.WAIT:
            assert tm.counts()[1] > 0 and tm.counts()[0] == 0
        else:
            assert tm.finished

    for kind, *args in ops:
        if kind == "get":
            give(args[0])
        elif kind in ("ok", "fail"):
            worker, index = args
            if not held[worker]:
                continue
            task = held[worker].pop(index % len(held[worker]))
            outcome = tm.report(task.task_id, worker, err_message="boom" if kind == "fail" else "")
            if outcome.accepted and kind == "ok":
                on_accepted_success(task)
        elif kind == "die":
            recovered = tm.recover_worker_tasks(args[0])
            mine = {t.task_id for t in held[args[0]]}
            assert {t.task_id for t in recovered} <= mine
            held[args[0]] = []
        elif kind == "tick":
            clock.advance(args[0])
        else:  # a report for a task this worker does not hold: always refused
            worker, task_id = args
            if any(t.task_id == task_id for t in held[worker]):
                continue
            before = snapshot(tm)
            assert not tm.report(task_id, worker).accepted
            assert snapshot(tm) == before

    # Drain: every worker dies, then one healthy worker finishes the job.
    for w in WORKERS:
        tm.recover_worker_tasks(w)
    for _ in range(1000):
        task = tm.get_task(9)
        if task is NoTask.END:
            break
        assert isinstance(task, Task)
        assert tm.report(task.task_id, 9).accepted
        on_accepted_success(task)
    else:
        raise AssertionError("job did not end")

    assert tm.finished and tm.counts() == (0, 0)
    assert len(tm.epochs) == num_epochs
    dropped = [(t.epoch, t.shard) for t in tm.dropped_tasks()]
    outcomes = sorted(completed + dropped, key=lambda x: (x[0], x[1].path, x[1].start))
    expected = sorted(
        ((e, s) for e in range(num_epochs) for s in shards), key=lambda x: (x[0], x[1].path, x[1].start)
    )
    assert outcomes == expected  # each shard of each epoch: completed xor dropped, exactly once
    for stats in tm.epochs:
        done = [s for e, s in completed if e == stats.epoch]
        assert stats.records_done == sum(s.records for s in done)
        assert stats.tasks_done == len(done)


def test_every_requeue_counts_as_an_interruption_with_its_cause():
    clock = FakeClock()
    tm = make_tm(make_shards(4), clock=clock, task_timeout=10.0, max_task_retries=3, shuffle=False)
    died, failed, late, left = (tm.get_task(w) for w in (1, 2, 3, 4))
    tm.progress(died.task_id, 1, 3)
    tm.recover_worker_tasks(1)  # SIGKILL'd after 3 records
    tm.report(failed.task_id, 2, "boom", 2)
    tm.report(left.task_id, 4, "", 5, interrupted=True)  # scale-down: its rest goes back
    clock.advance(11.0)
    assert tm.get_task(5).task_id == late.task_id  # the timeout is noticed here
    stats = tm.epochs[0]
    assert stats.tasks_interrupted == 4
    assert stats.requeues == {"worker died": 1, "task failed": 1, "worker left": 1, "timeout": 1}
    assert stats.retrained == {"worker died": 3, "task failed": 2}  # no PS to ask: all it trained
    assert stats.records_trained_twice == 5
