"""A checkpoint directory belongs to one job and one lineage: a second job is refused at
submit, and a job that starts over (its state store lost) never prunes, discards or overwrites
another lineage's cuts. The real JobState (in-memory store), PS cores and files on a tmp dir."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elasticdl.config import JobConfig
from elasticdl.master.cut_recovery import latest_cut
from elasticdl.master.job_state import JobState
from elasticdl.master.preflight import check_job
from elasticdl.model import checkpoint
from elasticdl.model.checkpoint_owner import (
    OWNER_FILE,
    CheckpointOwnerError,
    claim,
    lineage_floor,
    read_owner,
)
from tests.test_ps_server import grads, make_ps, model


def config(job_name: str, checkpoint_dir) -> JobConfig:
    cfg = JobConfig()
    cfg.job.job_name = job_name
    cfg.checkpoints.checkpoint_dir = str(checkpoint_dir)
    return cfg


def open_state(job_name: str, checkpoint_dir) -> JobState:
    """A master's start on a fresh in-memory store: the job starts over (no ledger to resume)."""
    state = JobState(config(job_name, checkpoint_dir), "train", "fingerprint", on_lost=lambda why: None)
    assert state.open(None) is False
    return state


def train(ckpt, term: int, versions: int, keep: int = 3):
    """A PS of leadership ``term`` making ``versions`` versions, a checkpoint at each."""
    ps = make_ps(params=model(), checkpoint_dir=str(ckpt), checkpoint_steps=1, keep_checkpoint_max=keep, term=term)
    for _ in range(versions):
        ps.push_gradients(grads(), ps.shard.version, None)
    return ps


def versions_of_term(ckpt, term: int) -> list[int]:
    return sorted(int(d.split("-")[1]) for d in os.listdir(ckpt) if d.startswith("version-")
                  and os.path.exists(os.path.join(ckpt, d, f"ps-0-of-1.term-{term}.npz")))


# ---------------------------------------------------------------- one job per directory


def test_a_second_job_on_a_checkpoint_dir_is_refused_at_submit(tmp_path):
    ckpt = tmp_path / "ckpt"
    open_state("job-a", ckpt).close(None, job_done=True)
    with pytest.raises(CheckpointOwnerError) as err:
        check_job(config("job-b", ckpt))  # the first check: before the data, the model, any process
    message = str(err.value)
    assert f"--checkpoint_dir {ckpt} belongs to job 'job-a'" in message
    assert "Give this job another --checkpoint_dir" in message
    assert f"--checkpoint_dir_for_init {ckpt}" in message and "--job_name job-a" in message


def test_a_job_that_continues_the_directory_takes_it_over_and_keeps_the_old_cuts(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = open_state("job-a", ckpt)
    train(ckpt, term=old.term, versions=3)
    cfg = config("job-b", ckpt)
    cfg.checkpoints.checkpoint_dir_for_init = str(ckpt)  # "continue from the latest" (docs/getting_started.md)
    state = JobState(cfg, "train", "fingerprint", on_lost=lambda why: None)
    state.open(None)
    assert read_owner(str(ckpt)).job_name == "job-b" and state.term > old.term
    train(ckpt, term=state.term, versions=5)
    assert versions_of_term(ckpt, old.term) == [1, 2, 3] and versions_of_term(ckpt, state.term) == [3, 4, 5]
    with pytest.raises(CheckpointOwnerError, match="belongs to job 'job-b'"):
        check_job(config("job-a", ckpt))


def test_the_owner_file_names_the_job_and_its_lineages(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = claim(str(ckpt), "job-a", resumed=False)
    assert claim(str(ckpt), "job-a", resumed=True) == first  # a resumed master continues its lineage
    second = claim(str(ckpt), "job-a", resumed=False)  # a start over: a new one
    owner = read_owner(str(ckpt))
    assert owner.job_name == "job-a" and owner.lineages == [first, second] and first.id != second.id
    assert json.loads((ckpt / OWNER_FILE).read_text())["job_name"] == "job-a"


def test_an_owner_file_that_is_not_one_names_the_fix(tmp_path):
    (tmp_path / OWNER_FILE).write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="is not an ElasticDL owner file .*remove it"):
        claim(str(tmp_path), "job-a", resumed=False)


# ---------------------------------------------------------------- lineages


def test_a_job_that_starts_over_keeps_its_own_final_checkpoint_and_the_old_lineage(tmp_path):
    """etcd lost its data: the job starts over under a low leadership term while the old
    lineage's cuts are of term 259. Pruning by term removed the new lineage's own cuts."""
    ckpt = tmp_path / "ckpt"
    claim(str(ckpt), "job-a", resumed=False)
    train(ckpt, term=259, versions=3)  # the old lineage: versions 1-3
    state = open_state("job-a", ckpt)  # a fresh store: its revisions start low again
    assert state.term > 259
    ps = train(ckpt, term=state.term, versions=5)
    assert ps.save_checkpoint().endswith("version-5")
    assert versions_of_term(ckpt, state.term) == [3, 4, 5]  # the newest three of its own
    assert versions_of_term(ckpt, 259) == [1, 2, 3]  # another lineage's: never pruned
    assert checkpoint.resolve_checkpoint(str(ckpt)).endswith("version-5")  # evaluate takes the newest lineage's
    assert latest_cut(str(ckpt), state.term_floor).version == 5


def test_a_rerun_never_overwrites_or_discards_the_previous_runs_cuts(tmp_path):
    """Two runs of a job on the in-memory store both got leadership term 1: the second wrote
    the first's file names, and its rollback removed the first's newer cuts."""
    ckpt = tmp_path / "ckpt"
    first = open_state("job-a", ckpt)
    train(ckpt, term=first.term, versions=4, keep=0)
    before = (ckpt / "version-4" / f"ps-0-of-1.term-{first.term}.npz").read_bytes()
    second = open_state("job-a", ckpt)
    assert second.term > first.term
    ps = train(ckpt, term=second.term, versions=4, keep=0)
    assert ps.roll_back(str(ckpt / "version-2"), term=second.term, fence_floor=1) == 2
    assert versions_of_term(ckpt, first.term) == [1, 2, 3, 4]
    assert (ckpt / "version-4" / f"ps-0-of-1.term-{first.term}.npz").read_bytes() == before
    assert versions_of_term(ckpt, second.term) == [1, 2]  # its own abandoned timeline is gone


def test_a_restart_of_the_same_lineage_rolls_back_only_to_its_own_cuts(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = open_state("job-a", ckpt)
    train(ckpt, term=old.term, versions=6, keep=0)
    new = open_state("job-a", ckpt)  # started over: no cut of its own yet
    assert latest_cut(str(ckpt), new.term_floor) is None  # a relaunch starts empty, not from the old run
    assert latest_cut(str(ckpt)).version == 6  # what evaluate would take


def test_a_ps_finds_its_lineages_floor_from_its_term(tmp_path):
    ckpt = str(tmp_path)
    assert lineage_floor(ckpt, 5) == -1  # no owner file: every term
    claim(ckpt, "job-a", resumed=False)  # base 0
    checkpoint.save_shard(ckpt, 0, 1, checkpoint.ShardState(1, 1, {"v": np.zeros(1, np.float32)}, {}, term=40))
    claim(ckpt, "job-a", resumed=False)  # base 40
    assert (lineage_floor(ckpt, 3), lineage_floor(ckpt, 41)) == (0, 40)


def test_legacy_cuts_without_an_owner_are_kept_by_the_first_lineage(tmp_path):
    ckpt = tmp_path / "ckpt"
    checkpoint.save_shard(str(ckpt), 0, 1, checkpoint.ShardState(9, 9, {"v": np.zeros(1, np.float32)}, {}, term=0))
    state = open_state("job-a", ckpt)
    train(ckpt, term=state.term, versions=4, keep=1)
    assert (ckpt / "version-9" / "ps-0-of-1.npz").exists()
    assert versions_of_term(ckpt, state.term) == [4]
