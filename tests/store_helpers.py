"""Helpers of the state store tests: a ledger snapshot maker and a polling wait."""

from __future__ import annotations

import time

from elasticdl.store import EpochRecord, LedgerSnapshot, TaskRecord, TaskState


def snap(seq: int, tasks: int = 4, epoch: int = 0, **changes) -> LedgerSnapshot:
    states = [TaskState.DONE, TaskState.DOING, TaskState.TODO, TaskState.DROPPED]
    records = tuple(
        TaskRecord(i, f"data/f{i % 2}.tfrecord", i * 10, i * 10 + 10, epoch, retries=i % 3,
                   state=states[i % 4], worker_id=1 if states[i % 4] is TaskState.DOING else -1)
        for i in range(tasks)
    )
    fields = dict(
        seq=seq, epoch=epoch, num_epochs=3, next_task_id=tasks, tasks=records,
        epochs=(EpochRecord(epoch, records_total=tasks * 10, records_done=10, records_duplicated=3,
                            tasks_done=1, tasks_retried=2),),
        job_fingerprint="digits-v1",
    )
    fields.update(changes)
    return LedgerSnapshot(**fields)


def wait_until(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.05)  # polls for a condition with a deadline: no timing window, cannot race
    return time.monotonic() - started
