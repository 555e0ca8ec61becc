"""The instance manager's decisions and the task ledger's elastic accounting, in process."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticdl.config.priority import high_count, parse_priority_spec
from elasticdl.data.sources import Shard
from elasticdl.master.instance_manager import (
    GiveUp,
    InstanceManager,
    Launch,
    Priority,
    Stop,
)
from elasticdl.master.task_manager import NoTask, TaskManager


def test_priority_spec():
    assert parse_priority_spec("high") == 1.0 and parse_priority_spec("LOW") == 0.0
    assert parse_priority_spec("0.5") == 0.5
    for bad in ("medium", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="--worker_pod_priority must be high, low or a fraction"):
            parse_priority_spec(bad)
    assert [high_count(0.5, n) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]


def test_initial_workers_get_priorities_by_fraction():
    manager = InstanceManager(4, 0.5)
    launches = manager.initial()
    assert [d.index for d in launches] == [0, 1, 2, 3]
    assert [d.priority for d in launches].count(Priority.HIGH) == 2


def test_scale_down_stops_low_priority_first_and_up_refills():
    manager = InstanceManager(4, 0.5)
    manager.initial()
    stops = manager.scale(2)
    assert all(isinstance(d, Stop) for d in stops)
    assert {manager.priority_of(d.index) for d in stops} == {Priority.LOW}
    for stop in stops:
        assert manager.on_exit(stop.index, 0) == []  # it left because we asked: no refill
    launches = manager.scale(3)
    assert len(launches) == 1 and launches[0].index == 4  # a new index, never reused
    assert launches[0].priority == Priority.LOW  # ceil(0.5 * 3) = 2 high already there


def test_crash_relaunches_up_to_the_limit_then_gives_up():
    manager = InstanceManager(1, 1.0, relaunch_limit=2)
    (first,) = manager.initial()
    index = first.index
    for _ in range(2):
        (decision,) = manager.on_exit(index, 1, "ValueError: bad record")
        assert isinstance(decision, Launch)
        index = decision.index
    (decision,) = manager.on_exit(index, 1, "ValueError: bad record")
    assert isinstance(decision, GiveUp)
    assert "crashed 3 times" in decision.error and "ValueError: bad record" in decision.error
    assert manager.relaunches == 2


def test_preemption_is_replaced_without_counting_a_crash():
    manager = InstanceManager(1, 1.0, relaunch_limit=0)
    (first,) = manager.initial()
    (killed,) = manager.on_exit(first.index, -9)  # SIGKILL: preempted
    (left,) = manager.on_exit(killed.index, 0)  # left on a SIGTERM nobody here sent
    assert isinstance(killed, Launch) and isinstance(left, Launch)
    assert manager.preemptions == 2 and manager.relaunches == 0
    assert manager.on_exit(left.index, 0, job_done=True) == []  # END: the job is over


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12), st.sampled_from(["high", "low", "0.3", "0.5"]))
def test_scaling_reaches_the_desired_count(targets, spec):
    manager = InstanceManager(2, parse_priority_spec(spec))
    live = {d.index for d in manager.initial()}
    for target in targets:
        for decision in manager.scale(target):
            if isinstance(decision, Launch):
                live.add(decision.index)
            else:
                live.discard(decision.index)
                manager.on_exit(decision.index, 0)
        assert len(live) == target == len(manager.live_indices)


def make_tasks(records=100, per_task=25, epochs=2) -> TaskManager:
    return TaskManager([Shard("f", s, min(s + per_task, records)) for s in range(0, records, per_task)], epochs)


def test_graceful_preemption_requeues_only_the_rest():
    tasks = make_tasks()
    task = tasks.get_task(0)
    tasks.progress(task.task_id, 0, 16)
    assert tasks.report(task.task_id, 0, records=16, interrupted=True).accepted
    stats = tasks.epochs[0]
    assert stats.records_done == 16 and stats.tasks_interrupted == 1 and stats.records_trained_twice == 0
    rest = tasks.get_task(1)
    assert (rest.shard.start, rest.shard.end) == (task.shard.start + 16, task.shard.end)


def test_an_interrupted_report_outside_the_task_is_refused():
    tasks = make_tasks()
    task = tasks.get_task(0)
    assert not tasks.report(task.task_id, 0, records=99, interrupted=True).accepted
    assert tasks.counts() == (3, 1)  # unchanged


def test_killed_worker_progress_counts_as_trained_twice():
    tasks = make_tasks()
    task = tasks.get_task(0)
    tasks.progress(task.task_id, 0, 10)
    tasks.progress(task.task_id, 1, 20)  # not its task: ignored
    tasks.recover_worker_tasks(0)
    assert tasks.epochs[0].records_trained_twice == 10
    assert tasks.get_task(1).task_id == task.task_id  # the whole task goes back


def test_every_record_trained_through_random_churn():
    tasks = make_tasks(records=200, per_task=30, epochs=3)
    worker, killed = 0, set()
    while True:
        task = tasks.get_task(worker)
        if task is NoTask.END:
            break
        if task is NoTask.WAIT:
            continue
        if task.task_id % 3 == 0 and task.records > 5:
            tasks.report(task.task_id, worker, records=5, interrupted=True)
        elif task.task_id % 5 == 0 and task.task_id not in killed:
            killed.add(task.task_id)
            tasks.progress(task.task_id, worker, 3)
            tasks.recover_worker_tasks(worker)
        else:
            tasks.report(task.task_id, worker)
        worker += 1
    assert [e.records_done for e in tasks.epochs] == [200, 200, 200]


def test_ledger_snapshot_round_trip_resumes_where_it_stopped():
    tasks = make_tasks(records=100, per_task=10, epochs=2)
    done = [tasks.get_task(0) for _ in range(3)]
    for task in done[:2]:
        tasks.report(task.task_id, 0)
    snapshot = tasks.snapshot("fp")
    assert snapshot.job_fingerprint == "fp"
    resumed = make_tasks(records=100, per_task=10, epochs=2)
    resumed.restore(type(snapshot).from_bytes(snapshot.to_bytes()))
    # The in-flight task comes first; the two finished ones never come back.
    handed = []
    while (task := resumed.get_task(1)) not in (NoTask.END, NoTask.WAIT):
        handed.append(task)
        resumed.report(task.task_id, 1)
    first_epoch = [t for t in handed if t.epoch == 0]
    assert first_epoch[0].task_id == done[2].task_id
    assert {t.task_id for t in done[:2]}.isdisjoint(t.task_id for t in first_epoch)
    assert [e.records_done for e in resumed.epochs] == [100, 100]
    # Epoch 1 is shuffled exactly as an uninterrupted run would (per-epoch seeds).
    straight = make_tasks(records=100, per_task=10, epochs=2)
    while (task := straight.get_task(0)) not in (NoTask.END, NoTask.WAIT):
        straight.report(task.task_id, 0)
        last_order = task
    assert last_order.shard == [t for t in handed if t.epoch == 1][-1].shard
