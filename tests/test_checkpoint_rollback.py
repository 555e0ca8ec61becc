"""A failed checkpoint write is counted in what may be missing.

How 8,590 records were lost: the disk filled, so the PS's checkpoint writes failed for a
while (training went on). A PS was then killed, and the job rolled back to the newest cut
on disk, written epochs earlier. The ledger keeps the done tasks of this epoch and the last
one only, so ``rewind`` put those back to todo; the records of the epochs in between stayed
counted done, and were in no model. The report said 0 possibly missing (that count was only
made for a job without --checkpoint_dir). Reproduced here with the real ledger, PS core and
checkpoint files on a tmp dir."""

from __future__ import annotations

import pytest

from elasticdl.data.sources import Shard
from elasticdl.master.cut_recovery import latest_cut, rewind_to_cut
from elasticdl.master.task_manager import TaskManager
from elasticdl.model import checkpoint
from elasticdl.rpc.batch_position import BatchPosition
from tests.test_ps_server import grads, make_ps, model

RECORDS = 50  # per task; two tasks an epoch


def ledger(epochs: int = 4) -> TaskManager:
    return TaskManager([Shard("f", 0, RECORDS), Shard("f", RECORDS, 2 * RECORDS)], num_epochs=epochs, shuffle=False)


def train_task(tasks: TaskManager, ps) -> None:
    """A worker takes a task, pushes all its records in one batch, and reports it."""
    task = tasks.get_task(0)
    ps.push_gradients(grads(), ps.shard.version, None,
                      batch=BatchPosition(task.task_id, task.handout, task.shard.end, task.records))
    assert tasks.report(task.task_id, 0).accepted


def test_a_rollback_to_a_cut_epochs_old_counts_the_records_it_cannot_train_again(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    tasks, ps = ledger(), make_ps(params=model(), checkpoint_dir=ckpt)
    for _ in range(2):  # epoch 0
        train_task(tasks, ps)
    assert ps.save_checkpoint().endswith("version-2")  # the last cut that could be written

    def full_disk(*args):
        raise checkpoint.CheckpointWriteError("could not write checkpoint: No space left on device")

    monkeypatch.setattr(checkpoint, "save_shard", full_disk)
    for _ in range(5):  # epochs 1 and 2, and half of epoch 3
        train_task(tasks, ps)
        with pytest.raises(checkpoint.CheckpointWriteError):
            ps.save_checkpoint()
    assert ps.checkpoint_failures == 5 and tasks.epoch == 3

    cut = latest_cut(ckpt)  # a PS died: the job goes back to the newest cut on disk
    assert (cut.version, cut.records_applied) == (2, [2 * RECORDS])
    rewound = rewind_to_cut(tasks, cut, "rollback")
    # Epochs 2 and 3 go back to todo; epoch 1's records stay counted done, and are in no model.
    assert rewound.retrained == 3 * RECORDS
    assert [e.records_done for e in tasks.epochs] == [2 * RECORDS, 2 * RECORDS, 0, 0]
    assert rewound.possibly_missing == 2 * RECORDS


def test_a_rollback_within_the_epoch_misses_nothing(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    tasks, ps = ledger(), make_ps(params=model(), checkpoint_dir=ckpt)
    for _ in range(3):
        train_task(tasks, ps)
    ps.save_checkpoint()
    train_task(tasks, ps)
    rewound = rewind_to_cut(tasks, latest_cut(ckpt), "rollback")
    assert (rewound.retrained, rewound.possibly_missing) == (RECORDS, 0)


def test_two_shards_that_applied_different_batches_miss_nothing(tmp_path):
    """Async: one shard applied a batch the other did not; the ledger trains it again from the
    lower mark, so nothing is missing."""
    ckpt = str(tmp_path / "ckpt")
    tasks = ledger()
    train_task(tasks, make_ps(params=model()))
    task = tasks.get_task(0)
    for ps_id, end in enumerate([2 * RECORDS, RECORDS + 25]):  # shard 1 lacks the task's last 25 records
        checkpoint.save_shard(ckpt, ps_id, 2, checkpoint.ShardState(
            3, 3, {}, {}, marks={0: RECORDS, task.task_id: end}, records_applied=end, term=1))
    cut = latest_cut(ckpt)
    assert cut.records_applied == [2 * RECORDS, RECORDS + 25]
    rewound = rewind_to_cut(tasks, cut, "rollback")
    assert (rewound.retrained, rewound.possibly_missing) == (0, 0)
    assert tasks.epochs[0].records_done == RECORDS + 25
