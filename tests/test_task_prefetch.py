"""Task read-ahead: the master's promise of each worker's next task (TaskManager.read_ahead),
driven step by step and as a property over random schedules, and the worker's reads of a
promised task in the background (TaskPrefetch), with gates instead of timing."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticdl.data.sources import Shard
from elasticdl.data.task_prefetch import TaskPrefetch
from elasticdl.master.task_manager import NoTask, Task, TaskManager

WAIT = 10.0


def _ledger(tasks: int = 6, **kwargs) -> TaskManager:
    shards = [Shard("data/f.parquet", 10 * i, 10 * (i + 1)) for i in range(tasks)]
    return TaskManager(shards, shuffle=False, **kwargs)


def test_a_worker_gets_the_task_it_was_promised():
    ledger = _ledger()
    first = ledger.get_task(0)
    assert first.shard.start == 0 and ledger.read_ahead(0) == Shard("data/f.parquet", 10, 20)
    second = ledger.get_task(1)  # another worker passes over worker 0's promise
    assert second.shard.start == 20 and ledger.read_ahead(1).start == 30
    assert ledger.get_task(0).shard.start == 10 and ledger.read_ahead(0).start == 40
    assert ledger.counts() == (3, 3)  # the ledger counts promised tasks as todo


def test_a_task_back_at_the_front_goes_first_and_the_promise_stands():
    ledger = _ledger()
    first = ledger.get_task(0)
    assert ledger.report(first.task_id, 0, err_message="boom").accepted  # back to the front
    again = ledger.get_task(0)
    assert again.task_id == first.task_id and again.retries == 1
    assert ledger.read_ahead(0).start == 10  # still promised: read ahead already, not in vain
    assert ledger.get_task(0).shard.start == 10


def test_a_dead_workers_promise_goes_to_the_next_worker():
    ledger = _ledger()
    ledger.get_task(0)
    ledger.get_task(1)
    ledger.recover_worker_tasks(0)
    assert ledger.read_ahead(0) is None
    # Its task went back to the front; then its promised task (10-20) is nobody's.
    assert ledger.get_task(2).shard.start == 0
    assert ledger.get_task(2).shard.start == 10


def test_when_every_task_left_is_promised_one_is_taken_and_that_promise_broken():
    ledger = _ledger(tasks=3)
    ledger.get_task(0)  # promised 10-20
    ledger.get_task(1)  # 20-30; nothing left to promise
    assert ledger.read_ahead(1) is None
    taken = ledger.get_task(1)
    assert taken.shard.start == 10 and ledger.read_ahead(0) is None
    assert ledger.get_task(0) is NoTask.WAIT


def test_a_rollback_and_a_resumed_ledger_end_every_promise():
    ledger = _ledger()
    ledger.get_task(0)
    ledger.rewind({})
    assert ledger.read_ahead(0) is None
    assert ledger.get_task(1).shard.start == 0
    snapshot = ledger.snapshot()
    resumed = _ledger()
    resumed.get_task(0)
    resumed.restore(snapshot)
    assert resumed.read_ahead(0) is None


@given(st.lists(st.tuples(st.sampled_from(["get", "report", "die"]), st.integers(0, 3)), max_size=80))
def test_promises_never_hand_a_task_out_twice_nor_lose_one(schedule):
    ledger = _ledger(tasks=7, num_epochs=2)
    held: dict[int, Task] = {}  # worker -> the task it trains

    def check():
        held_ids = [t.task_id for t in held.values()]
        assert len(held_ids) == len(set(held_ids))  # no task held by two workers
        for worker in range(4):
            promised = ledger.read_ahead(worker)
            assert promised is None or promised not in [t.shard for t in held.values()]

    for action, worker in schedule:
        if action == "get" and worker not in held:
            task = ledger.get_task(worker)
            if isinstance(task, Task):
                held[worker] = task
        elif action == "report" and worker in held:
            assert ledger.report(held.pop(worker).task_id, worker).accepted
        elif action == "die":
            held.pop(worker, None)
            ledger.recover_worker_tasks(worker)
        check()
    for worker, task in held.items():
        assert ledger.report(task.task_id, worker).accepted
    while not ledger.finished:  # one worker trains what is left
        task = ledger.get_task(0)
        assert isinstance(task, Task)
        assert ledger.report(task.task_id, 0).accepted
    assert [e.records_done for e in ledger.epochs] == [70, 70]  # every record once in each epoch


def test_a_task_read_ahead_is_taken_from_the_background():
    gate = threading.Event()
    loads = []

    def load(key):
        loads.append((key, threading.current_thread().name))
        if key == "b":
            assert gate.wait(WAIT)
        return f"records of {key}"

    reads = TaskPrefetch(load)
    reads.start("b")
    assert reads.take("a") == "records of a"  # not started: read here
    gate.set()
    assert reads.take("b") == "records of b"
    assert [key for key, _ in loads] == ["b", "a"] or [key for key, _ in loads] == ["a", "b"]
    threads = dict(loads)
    assert threads["a"] == threading.current_thread().name and threads["b"].startswith("task-read-ahead")
    assert (reads.taken, reads.taken_ahead) == (2, 1)
    reads.close()


def test_a_failed_read_ahead_is_read_again_where_its_error_is_the_tasks():
    attempts = []

    def load(key):
        attempts.append(key)
        if len(attempts) == 1:
            raise OSError("connection reset")
        if len(attempts) == 2:
            raise ValueError("the file is corrupt")
        return "unreachable"

    reads = TaskPrefetch(load)
    reads.start("a")
    with pytest.raises(ValueError, match="corrupt"):  # the second read's error, raised by take
        reads.take("a")
    assert attempts == ["a", "a"] and reads.taken_ahead == 0
    reads.close()


def test_reads_not_taken_are_disposed_and_at_most_depth_are_held():
    gates = {k: threading.Event() for k in "abc"}
    disposed = []
    done = threading.Semaphore(0)

    def load(key):
        assert gates[key].wait(WAIT)
        return key

    def dispose(value):
        disposed.append(value)
        done.release()

    reads = TaskPrefetch(load, dispose=dispose, depth=2)
    for key in "abc":
        reads.start(key)  # "a", the oldest, is dropped once it is read
    gates["a"].set()
    assert done.acquire(timeout=WAIT) and disposed == ["a"]
    gates["b"].set()
    gates["c"].set()
    assert reads.take("c") == "c"
    reads.close()  # "b" was never taken
    assert done.acquire(timeout=WAIT) and disposed == ["a", "b"]


def test_a_task_read_ahead_comes_cut_into_its_batches(tmp_path):
    """The chunks BatchStream feeds are cut in the thread that read the task, once per size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elasticdl.data.sources import load_records

    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"x": list(range(50)), "ids": [[i] * (i % 3) for i in range(50)]}), path)
    records, corrupt = load_records(path, 5, 45, as_columns=True, batch_size=8)
    assert corrupt == [] and list(records._chunks) == [8]  # cut when read
    chunks = records.chunks(8)
    assert records.chunks(8) is chunks and len(chunks) == 5  # not cut again
    assert [c[0].tolist() for c in chunks] == [list(range(5 + 8 * k, min(45, 13 + 8 * k))) for k in range(5)]
    fives = records.chunks(5)  # another size: cut for it
    assert len(fives) == 8 and fives[1][0].tolist() == list(range(10, 15))
    assert [c[2].tolist() for c in chunks][0] == [0, 2, 2, 3, 5, 5, 6, 8, 8]  # rows 5-12's offsets
