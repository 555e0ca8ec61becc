"""The simulator with shard replicas (``--mode replicas``, issue 26): the real ReplicaHost,
PrimaryLog and BackupApplier on each simulated PS, the real controller's PromoteBackup and
AddBackup, and the invariants that a backup equals its primary at every update, a promoted
backup holds every acknowledged update, and one PS death rolls nothing back."""

from __future__ import annotations

import functools

import pytest

from elasticdl.master.failover import ReplicaRoles
from elasticdl.ps.replication import PrimaryLog
from elasticdl.sim.planted import planted
from tests.sim_support import clean_runs_without_faults, quiet  # noqa: F401  the fixture
from tests.sim_support import run as run_world

# Seeds replayed by the tests below (their fault schedules in the ids).
RESUMED_WITH_A_CUT = (59, 273)  # a master restart: every PS from the cut, each backup too
PLANTED_BACKUP_TWICE = 58  # a forward taken twice by a backup (duplicated on the network)
ONE_DEATH = 17  # one PS killed: its shard promoted, the dead PS back as a spare and caught up


pytestmark = pytest.mark.usefixtures("quiet")

run = functools.partial(run_world, family="replicas")


def test_without_faults_replicas_end_with_every_record_applied_once_and_backups_equal():
    for world in clean_runs_without_faults("replicas"):
        assert world.mode.ps_replicas >= 1 and world.replica_ledger.acked  # updates were forwarded and taken


@pytest.mark.parametrize("seed", RESUMED_WITH_A_CUT)
def test_a_resumed_job_restores_each_backup_from_the_cut_as_its_primary(seed):
    """Before the fix (elasticdl/ps/replica_host.py backup_core), a backup started empty while its
    primary loaded the cut: the first forwarded push failed on it, forever."""
    world = run(seed)
    assert any("master" in fault for fault in world.result.faults)
    assert world.result.violations == [] and world.result.outcome == "finished", world.result.violations


def test_one_ps_death_promotes_its_shards_backup_and_rolls_nothing_back():
    world = run(ONE_DEATH)
    assert world.nemesis.ps_kills == 1 and world.masters_started == 1, world.result.faults
    assert world.result.violations == [], world.result.violations
    roles = world.master.controller.replicas
    assert roles.records and world.rollbacks == 0
    dead = roles.records[0].old_primary
    assert any(dead in backups for backups in roles.backups)  # relaunched, it caught up as a backup


def test_the_no_rollback_invariant_finds_a_ps_death_that_goes_back_to_the_cut(monkeypatch):
    """With no backup promoted (the recovery policy planted to fall back), the same seed's one
    PS death goes back to the cut, and the invariant says so."""
    monkeypatch.setattr("elasticdl.master.failover.plan_failover", lambda facts: None)
    world = run(ONE_DEATH)
    assert any("went back to a checkpoint or started over" in v for v in world.result.violations)


def test_finds_a_backup_that_applies_a_forwarded_update_twice_planted_back():
    with planted("backup-twice"):
        world = run(PLANTED_BACKUP_TWICE)
    assert any("differs from what its primary held" in v for v in world.result.violations), world.result.violations
    assert run(PLANTED_BACKUP_TWICE).result.violations == []  # the real applier takes a second copy once


def test_finds_a_promoted_backup_that_lacks_an_acknowledged_update(monkeypatch):
    """A primary that answers without forwarding (its backups listed, never sent a thing): the
    backup promoted at the death holds none of what the workers saw acknowledged."""
    monkeypatch.setattr(PrimaryLog, "deliver", lambda self, entry: None)
    world = run(ONE_DEATH)
    assert any("its primary had acknowledged update" in v for v in world.result.violations), world.result.violations


# Fixed: a shard's last caught-up replica died while the PS relaunched as a spare had not caught
# up. The fallback went back to the cut, but the spare (still starting) was neither rolled back
# nor told the routes: no PS served its shard and the job stopped making progress (seed 24; a real
# job hung the same way). Now a PS that cannot go back to the cut starts again from it.
FIXED_SPARE_FALLBACK = 24
# Fixed too, the same without a checkpoint (seeds 185, 192, 359 of 400, all no-ckpt): the spare
# served its shard from an empty core, and what it lost was not counted missing. A PS that has
# not caught up now never counts as holding its shard: the fallback names it lost, and without a
# checkpoint it starts again empty as the dead PS does, its shard's loss counted (seeds 185, 359);
# after the last task, with nothing to refill it from, the job fails naming --checkpoint_dir, as
# it does without replicas (seed 192: a promotion to a backup that had died too).
SPARE_FALLBACK_WITHOUT_A_CHECKPOINT = (185, 359)
SHARD_LOST_AFTER_THE_LAST_TASK = 192
FAILED_PROMOTION_AFTER_THE_LAST_TASK = (433, 700)
BUDGET = range(22, 30)


def test_a_spare_not_caught_up_when_the_last_replica_dies_starts_again_from_the_cut():
    world = run(FIXED_SPARE_FALLBACK)
    assert world.result.violations == [], world.result.violations[:2]


@pytest.mark.parametrize("seed", SPARE_FALLBACK_WITHOUT_A_CHECKPOINT)
def test_without_a_checkpoint_a_spare_not_caught_up_starts_again_empty_and_its_loss_is_counted(seed):
    world = run(seed)
    assert not world.checkpoint_dir and world.result.outcome == "finished"
    assert world.result.violations == [], world.result.violations[:2]


def test_seed_185s_spare_is_refilled_with_its_shards_records_counted_possibly_missing():
    world = run(SPARE_FALLBACK_WITHOUT_A_CHECKPOINT[0])
    assert [f.split(" ", 1)[1] for f in world.result.faults if "kill" in f] == ["kill ps 0", "kill ps 1"]
    lost = [(r.ps, r.to_version) for r in world.master.controller.rollbacks if r.records_possibly_missing > 0]
    assert lost == [(0, None), (1, None)]  # the spare (PS 0) as well as the dead PS 1


def test_without_a_checkpoint_a_shard_lost_after_the_last_task_fails_the_job_naming_the_fix():
    world = run(SHARD_LOST_AFTER_THE_LAST_TASK)
    assert world.result.violations == [], world.result.violations[:2]
    assert world.result.outcome == "failed: a shard lost without a checkpoint"
    assert "--checkpoint_dir" in world.outcome.error


def test_a_budget_of_seeds_holds_every_invariant_and_falls_back_while_a_spare_catches_up(monkeypatch):
    fallbacks: list[tuple[int, ...]] = []
    saved = ReplicaRoles._fall_back

    def fall_back(self, dead):
        decision = saved(self, dead)
        fallbacks.append(decision.lost)
        return decision

    monkeypatch.setattr(ReplicaRoles, "_fall_back", fall_back)
    for seed in [*BUDGET, *SPARE_FALLBACK_WITHOUT_A_CHECKPOINT, SHARD_LOST_AFTER_THE_LAST_TASK,
                 *FAILED_PROMOTION_AFTER_THE_LAST_TASK]:
        world = run(seed)
        assert world.result.violations == [], (seed, world.result.faults, world.result.violations[:2])
    assert any(fallbacks)  # the class is exercised: a fallback with a spare lost


@pytest.mark.parametrize("seed", FAILED_PROMOTION_AFTER_THE_LAST_TASK)
def test_a_failed_promotion_after_the_last_task_keeps_the_job_open_until_the_cut_is_restored(seed):
    """Both PS killed after the last task; the promotion to the dead backup failed. Seed 433:
    the job ended its workers before the fallback's relaunch rewound the ledger (it failed,
    every worker gone). Seed 700: it ended while a PS relaunched from the cut still started,
    the shards at different versions (the end now waits for them to be leveled again)."""
    world = run(seed)
    assert world.result.violations == [] and world.result.outcome == "finished", world.result.violations[:2]
