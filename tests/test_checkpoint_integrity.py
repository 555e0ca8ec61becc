"""A checkpoint counts only once its checksums verify: damaged and partial cuts are passed
over for the previous complete one, by name; a damaged cut named explicitly is an error; the
master reading a cut's data position never crashes. Checkpoint files on a tmp dir, no processes."""

from __future__ import annotations

import logging
import os
import zipfile

import numpy as np
import pytest

from elasticdl.master.cut_recovery import latest_cut
from elasticdl.model import checkpoint
from elasticdl.model.checkpoint_integrity import CHECKSUM_KEY, DamagedCheckpointError, verify_shard
from tests.test_ps_server import make_ps


def shard(version: int, term: int = 1, value: float = 0.0, marks=None) -> checkpoint.ShardState:
    marks = {1: version} if marks is None else marks
    return checkpoint.ShardState(version, version, {"v": np.full(3, value, np.float32)}, {}, marks=marks,
                                 records_applied=sum(marks.values()), term=term)


def write_cut(directory, version: int, num_ps: int = 2, value: float | None = None) -> list[str]:
    return [checkpoint.save_shard(str(directory), i, num_ps, shard(version, value=version if value is None else value))
            for i in range(num_ps)]


def shard_path(directory, version: int, ps_id: int = 1, num_ps: int = 2) -> str:
    return os.path.join(str(directory), f"version-{version}", f"ps-{ps_id}-of-{num_ps}.term-1.npz")


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def rewrite_arrays(path: str, **changes) -> None:
    """A well-formed .npz whose arrays differ from what was written (its old checksum kept):
    the zip CRCs are right, only the checksum can tell."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    arrays.update(changes)
    os.remove(path)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


# ---------------------------------------------------------------- what a shard carries


def test_a_shard_carries_the_checksum_of_its_arrays_and_verifies(tmp_path):
    [path, _] = write_cut(tmp_path, 4)
    with np.load(path) as data:
        assert CHECKSUM_KEY in data.files
    assert verify_shard(path) is True


def test_a_shard_whose_arrays_changed_does_not_verify(tmp_path):
    [path, _] = write_cut(tmp_path, 4)
    rewrite_arrays(path, **{"param:v": np.full(3, 7.0, np.float32)})
    with pytest.raises(DamagedCheckpointError, match=r"ps-0-of-2\.term-1\.npz is damaged: its sha256 is"):
        verify_shard(path)


def test_an_old_shard_without_a_checksum_still_loads_unverified(tmp_path, caplog):
    [path] = write_cut(tmp_path, 4, num_ps=1)
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files if name != CHECKSUM_KEY}
    os.remove(path)
    np.savez(path, **arrays)  # as an ElasticDL before checksums wrote it
    with caplog.at_level(logging.INFO):
        state = checkpoint.load_shard(str(tmp_path), 0, 1)
    assert state.version == 4 and state.marks == {1: 4}
    assert "has no checksum" in caplog.text


def test_an_old_shard_without_a_checksum_is_still_checked_by_its_zip_crcs(tmp_path):
    [path] = write_cut(tmp_path, 4, num_ps=1)
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files if name != CHECKSUM_KEY}
    os.remove(path)
    np.savez(path, **arrays)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("param:v.npy")
    data = bytearray(open(path, "rb").read())
    data[info.header_offset + 30 + len(info.filename) + info.extra.__len__() + 130] ^= 0xFF  # a byte of v
    open(path, "wb").write(bytes(data))
    with pytest.raises(DamagedCheckpointError, match="damaged"):
        verify_shard(path)


# ---------------------------------------------------------------- falling back


def test_a_truncated_newest_shard_falls_back_to_the_previous_cut_by_name(tmp_path, caplog):
    write_cut(tmp_path, 4)
    write_cut(tmp_path, 8)
    truncate(shard_path(tmp_path, 8))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.resolve_checkpoint(str(tmp_path)).endswith("version-4")
    assert f"passed over checkpoint {tmp_path}/version-8" in caplog.text
    assert "ps-1-of-2.term-1.npz is damaged: truncated" in caplog.text
    assert checkpoint.load_shard(str(tmp_path), 0, 2).version == 4  # the PS (evaluate, predict) too


def test_a_newest_cut_with_changed_arrays_falls_back(tmp_path):
    write_cut(tmp_path, 4)
    write_cut(tmp_path, 8)
    rewrite_arrays(shard_path(tmp_path, 8, ps_id=0), **{"__version__": np.array(80, np.int64)})
    assert checkpoint.cut_position(str(tmp_path))[0] == 4


def test_an_explicitly_named_damaged_cut_is_an_error_naming_the_file_and_the_fix(tmp_path):
    write_cut(tmp_path, 4)
    write_cut(tmp_path, 8)
    truncate(shard_path(tmp_path, 8))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load_shard(str(tmp_path / "version-8"), 0, 2)
    message = str(err.value)
    assert shard_path(tmp_path, 8) in message and "is damaged" in message
    assert f"Pass the checkpoint directory {tmp_path} to use the newest checkpoint that verifies" in message


def test_an_incomplete_newest_cut_is_named_when_an_older_one_is_used(tmp_path, caplog):
    """evaluate on a directory whose newest cut holds one shard of two: it uses the older cut, and says so."""
    write_cut(tmp_path, 743)
    checkpoint.save_shard(str(tmp_path), 0, 2, shard(745))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.resolve_checkpoint(str(tmp_path)).endswith("version-743")
    assert (f"checkpoint {tmp_path}/version-745 is incomplete (ps-1-of-2.term-1.npz is missing): using "
            f"{tmp_path}/version-743") in caplog.text


def test_an_incomplete_explicit_cut_names_what_is_missing(tmp_path):
    checkpoint.save_shard(str(tmp_path), 0, 2, shard(745))
    with pytest.raises(checkpoint.CheckpointError, match=r"version-745 is incomplete: ps-1-of-2.term-1.npz is missing"):
        checkpoint.resolve_checkpoint(str(tmp_path / "version-745"))


def test_no_usable_cut_says_how_many_were_damaged(tmp_path):
    write_cut(tmp_path, 4)
    truncate(shard_path(tmp_path, 4))
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint under .*: 1 complete ones are damaged"):
        checkpoint.resolve_checkpoint(str(tmp_path))


# ---------------------------------------------------------------- the master and the PS


def test_the_master_reads_a_cut_past_a_truncated_survivor_shard(tmp_path):
    """A PS died and a survivor's newest shard is truncated: the master picks the cut before it."""
    write_cut(tmp_path, 4)
    write_cut(tmp_path, 8)
    truncate(shard_path(tmp_path, 8, ps_id=0))
    cut = latest_cut(str(tmp_path))
    assert cut is not None and (cut.version, cut.path, cut.marks) == (4, str(tmp_path / "version-4"), {1: 4})


def test_cut_position_of_garbage_raises_only_a_checkpoint_error(tmp_path):
    write_cut(tmp_path, 4)
    with open(shard_path(tmp_path, 4), "wb") as f:
        f.write(b"PK\x03\x04 not a zip at all")
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.cut_position(str(tmp_path / "version-4"))
    assert latest_cut(str(tmp_path)) is None


def test_a_relaunched_ps_and_the_survivors_restore_the_previous_cut(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_cut(ckpt, 4, value=1.0)
    write_cut(ckpt, 8, value=2.0)
    truncate(shard_path(ckpt, 8, ps_id=1))
    cut = latest_cut(str(ckpt))
    relaunched = make_ps(ps_id=1, num_ps=2, term=1, checkpoint_dir=str(ckpt), checkpoint_dir_for_init=cut.path,
                         restore_position=True)
    relaunched.restore()
    survivor = make_ps(ps_id=0, num_ps=2, checkpoint_dir=str(ckpt))
    assert survivor.roll_back(cut.path, term=1, fence_floor=5) == 4
    assert relaunched.shard.version == 4
    # the damaged cut's files are of the abandoned timeline: gone, so they never complete a cut again
    assert not os.listdir(ckpt / "version-8")
