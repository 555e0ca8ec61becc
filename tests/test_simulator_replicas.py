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


# Open (docs/reliability.md, "Known gaps"): a shard's last caught-up replica dies while the PS
# relaunched as a spare has not caught up yet. The fallback goes back to the cut, but the spare
# (still starting) is neither rolled back nor told the routes: the shard it held is served by no
# PS (the job stops making progress) or, without a checkpoint, from the spare's empty core. All
# 12 violating seeds of 2,000 are this class; seed 24 is the first.
OPEN_SPARE_FALLBACK = 24
BUDGET = range(22, 30)


def test_a_budget_of_seeds_finds_only_the_open_class_a_fallback_while_a_spare_catches_up(monkeypatch):
    fallbacks: list[bool] = []
    saved = ReplicaRoles._fall_back

    def fall_back(self, dead):
        fallbacks.append(bool(self._spares or self._adding))  # a relaunched PS not caught up yet
        return saved(self, dead)

    monkeypatch.setattr(ReplicaRoles, "_fall_back", fall_back)
    violating = []
    for seed in BUDGET:
        fallbacks.clear()
        world = run(seed)
        if world.result.violations:
            violating.append(seed)
            assert any(fallbacks), (seed, world.result.faults, world.result.violations[:2])
    assert OPEN_SPARE_FALLBACK in violating  # drop this line, and the docs' entry, once it is fixed
