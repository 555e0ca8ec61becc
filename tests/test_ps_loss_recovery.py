"""The executor of the recovery policy (``Recovery._relaunch_ps``) on real checkpoint files and a
real ledger, with the backend and the PS client faked.

Chaos seed 48 (DeepFM, 2 PS, sync): the only complete cut was damaged, then a PS was killed. The
job relaunched that PS empty, refilled from a worker's copy, while the ledger kept going: its
shard's own count started over (the PS files held [5000, 3512] records of 6000), the report said
`exactly_once.holds: false` with 64 records possibly missing, and the shards ended at different
versions (the final cut on disk older than the one the report named). With checkpoints kept and
no usable cut, every PS now starts over at version 0 and the ledger goes back to the start."""

from __future__ import annotations

import os
from types import SimpleNamespace

from elasticdl.data.sources import Shard
from elasticdl.master import controller as c
from elasticdl.master.recovery import Recovery
from elasticdl.master.task_manager import TaskManager
from elasticdl.model import checkpoint

RECORDS = 50
TERM = 2


class FakeBackend:
    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, role, index, args, env=None, priority=None):
        self.calls.append(("start", role, index, tuple(args)))

    def stop(self, role, index, timeout=10.0):
        self.calls.append(("stop", role, index))


class FakePS:
    def __init__(self, num_ps):
        self.num_ps = num_ps
        self.restored: list[tuple] = []

    def restore_each(self, path, fence, only=None):
        self.restored.append((path, fence, tuple(only)))
        return {}  # every one went back


def job(ckpt: str, tasks: TaskManager | None, num_ps: int = 2) -> Recovery:
    rec = Recovery()
    rec.config = SimpleNamespace(
        checkpoints=SimpleNamespace(checkpoint_dir=ckpt),
        consistency=SimpleNamespace(get_model_steps=1, push_steps=1, overlap_communication=False),
        training=SimpleNamespace(minibatch_size=32),
    )
    rec._ps, rec.backend, rec.main_tasks = FakePS(num_ps), FakeBackend(), tasks
    rec.state = SimpleNamespace(term=TERM, term_floor=0)
    rec.controller = SimpleNamespace(workers={0, 1})
    rec._ps_args = [["--ps_id", str(i)] for i in range(num_ps)]
    rec.ps_addresses = [f"127.0.0.1:{5000 + i}" for i in range(num_ps)]
    rec.dispatcher = SimpleNamespace(bad_records=lambda: [])
    rec.checked = SimpleNamespace(files=[])
    rec._restarted = set()  # Job's: roles the recovery started again (their polled exits are stale)
    return rec


def ledger() -> TaskManager:
    return TaskManager([Shard("f", 0, RECORDS), Shard("f", RECORDS, 2 * RECORDS)], num_epochs=3,
                       shuffle=False, fences_pushes=True)


def save_cut(ckpt: str, version: int, records: int, num_ps: int = 2) -> list[str]:
    return [checkpoint.save_shard(ckpt, i, num_ps, checkpoint.ShardState(
        version, version, {}, {}, marks={0: records}, records_applied=records, term=TERM)) for i in range(num_ps)]


def damage(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def train(tasks: TaskManager, n: int) -> None:
    for _ in range(n):
        task = tasks.get_task(0)
        assert tasks.report(task.task_id, 0).accepted


def test_the_only_cut_damaged_then_a_ps_killed_starts_every_ps_over_and_the_ledger_from_the_start(tmp_path):
    ckpt, tasks = str(tmp_path / "ckpt"), ledger()
    train(tasks, 1)
    shards = save_cut(ckpt, 20, RECORDS)
    damage(shards[1])  # the nemesis: the only complete cut damaged
    partial = checkpoint.save_shard(ckpt, 0, 2, checkpoint.ShardState(30, 30, {}, {}, term=TERM))  # no ps-1 file
    train(tasks, 2)  # into epoch 1
    rec = job(ckpt, tasks)

    relaunched = rec._relaunch_ps(c.ProcessExit("ps", 1, -9, ""))

    # Every PS starts again empty, fenced past every hand-out made so far; the survivor was
    # stopped first (a planned stop, not a death).
    calls = rec.backend.calls
    assert calls[0] == ("stop", "ps", 0)
    started = {call[2]: call[3] for call in calls if call[0] == "start"}
    assert sorted(started) == [0, 1]
    for index, args in started.items():
        assert "--restore_from" not in args
        assert args[args.index("--port") + 1] == str(5000 + index)
        assert int(args[args.index("--fence") + 1]) > 0
    assert rec._ps.restored == []  # nothing to roll back to
    # The ledger back to the start: every record trained again, none counted missing.
    assert [e.records_done for e in tasks.epochs] == [0, 0]
    assert relaunched == c.PSRelaunched(1, 0, retrained=3 * RECORDS, missing=0)
    # The abandoned timeline's files are gone: none can make a cut with the new timeline's.
    assert not any(os.path.exists(p) for p in [*shards, partial])
    assert os.listdir(ckpt) == []  # nor their emptied version directories


def test_a_verified_cut_is_restored_and_the_survivors_roll_back(tmp_path):
    ckpt, tasks = str(tmp_path / "ckpt"), ledger()
    train(tasks, 1)
    save_cut(ckpt, 20, RECORDS)
    train(tasks, 1)
    rec = job(ckpt, tasks)

    relaunched = rec._relaunch_ps(c.ProcessExit("ps", 1, -9, ""))

    [(_, _, index, args)] = rec.backend.calls
    assert index == 1 and args[args.index("--restore_from") + 1] == f"{ckpt}/version-20"
    [(path, fence, only)] = rec._ps.restored
    assert (path, only) == (f"{ckpt}/version-20", (0,)) and fence > 0
    assert relaunched == c.PSRelaunched(1, 20, retrained=RECORDS, missing=0)


def test_without_a_checkpoint_dir_the_dead_ps_alone_is_refilled_and_the_loss_counted(tmp_path):
    tasks = ledger()
    train(tasks, 1)
    rec = job("", tasks)

    relaunched = rec._relaunch_ps(c.ProcessExit("ps", 1, -9, ""))

    [(kind, _, index, args)] = rec.backend.calls
    assert (kind, index, "--fence" in args) == ("start", 1, False)
    assert relaunched == c.PSRelaunched(1, None, missing=2 * 32)  # a batch of each of the 2 workers
    assert tasks.epochs[0].records_done == RECORDS  # the ledger keeps going


def resumed(ckpt: str, tasks: TaskManager, resume_cut: str = "") -> Recovery:
    rec = job(ckpt, tasks)
    rec._resume_cut, rec.records_possibly_missing = resume_cut, 0
    return rec


def test_a_master_resumed_with_checkpoints_kept_but_none_usable_trains_every_record_again(tmp_path):
    """A resumed ledger counted its done records as possibly missing whenever no cut could be
    restored, though checkpoints were kept: the PS started from the initial model and those
    records were never trained again. Now the ledger goes back to the start."""
    ckpt, tasks = str(tmp_path / "ckpt"), ledger()
    train(tasks, 3)  # the ledger the master resumed from the store
    stale = checkpoint.save_shard(ckpt, 0, 2, checkpoint.ShardState(20, 20, {}, {}, term=TERM))  # a partial cut
    rec = resumed(ckpt, tasks)

    rec._rewind_to_restored_cut()

    assert rec.records_possibly_missing == 0
    assert [e.records_done for e in tasks.epochs] == [0, 0]
    assert not os.path.exists(stale)


def test_a_master_resumed_from_a_cut_trains_again_what_is_after_it(tmp_path):
    ckpt, tasks = str(tmp_path / "ckpt"), ledger()
    train(tasks, 1)
    save_cut(ckpt, 20, RECORDS)
    train(tasks, 1)
    rec = resumed(ckpt, tasks, f"{ckpt}/version-20")

    rec._rewind_to_restored_cut()

    assert rec.records_possibly_missing == 0
    assert [e.records_done for e in tasks.epochs] == [RECORDS]


def test_a_master_resumed_without_checkpoints_counts_the_done_records_as_possibly_missing():
    tasks = ledger()
    train(tasks, 3)
    rec = resumed("", tasks)

    rec._rewind_to_restored_cut()

    assert rec.records_possibly_missing == 3 * RECORDS
    assert [e.records_done for e in tasks.epochs] == [2 * RECORDS, RECORDS]
