"""--ps_replicas in the controller (pure): a PS death promotes its shards' backups, the relaunch
waits for the answer and brings the PS back as a spare; a shard with no live replica left falls
back to the cut (docs/replicas.md)."""

from __future__ import annotations

from elasticdl.data.sources import Shard
from elasticdl.launch.api import ProcessExit
from elasticdl.master import controller as c
from elasticdl.master.evaluation_service import TaskDispatcher
from elasticdl.master.failover import FailoverRecord, ReplicaRoles
from elasticdl.master.instance_manager import InstanceManager
from elasticdl.master.recovery_policy import FailoverFacts, Promote, plan_failover
from elasticdl.master.task_manager import TaskManager, TaskType


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def shards(tasks: int, records: int = 10) -> list[Shard]:
    return [Shard("data.rec", i * records, (i + 1) * records) for i in range(tasks)]


def make(num_ps: int, replicas: int):
    clock = FakeClock()
    main = TaskManager(shards(2), num_epochs=1, clock=clock, shuffle=False, task_type=TaskType.TRAINING)
    ctl = c.Controller("train", TaskDispatcher(main, None), InstanceManager(1), clock=clock, sync_mode=True,
                       replica_roles=ReplicaRoles.initial(num_ps, replicas))
    ctl.start()
    return ctl, clock


def of(decisions, kind) -> list:
    """The decisions of one kind (the controller adds what else is due: SaveLedger, ...)."""
    return [d for d in decisions if isinstance(d, kind)]


def ps_exit(index: int) -> c.RoleExited:
    return c.RoleExited(ProcessExit("ps", index, -9, ""))


def test_the_recovery_policy_prefers_promotion_and_falls_back_when_a_shard_has_no_live_replica():
    backups = ((1,), (2,), (0,))
    assert plan_failover(FailoverFacts(dead=1, led=(1,), backups=backups)) == Promote(((1, 2),))
    assert plan_failover(FailoverFacts(dead=1, led=(1, 0), backups=((1,), (2,), (0,)))) is None  # shard 0's only backup died with it
    assert plan_failover(FailoverFacts(dead=1, led=(1,), backups=((), (1, 2), ()))) == Promote(((1, 2),))


def test_a_primary_death_promotes_its_backup_then_relaunches_it_as_a_spare_with_nothing_rolled_back():
    ctl, clock = make(num_ps=2, replicas=1)
    decisions = ctl.step(ps_exit(1))
    assert of(decisions, c.RelaunchPS) == []  # not before the backup is primary
    [promote] = of(decisions, c.PromoteBackup)
    assert promote == c.PromoteBackup(dead=1, promotions=((1, 0),), backups=((), ()), primary=(0, 0), routes_version=1)
    clock.now += 0.5
    [relaunch] = of(ctl.step(c.BackupPromoted(1, ((1, 0),), (37,))), c.RelaunchPS)
    assert relaunch == c.RelaunchPS(ProcessExit("ps", 1, -9, ""), moved_to=((1, 0),))
    assert ctl.replicas.records == [FailoverRecord(1, 1, 0, 0.5, 37)]
    assert ctl.rollbacks == []


def test_with_three_ps_the_first_live_backup_on_the_ring_takes_over_and_the_dead_ps_leaves_every_backup_list():
    ctl, _ = make(num_ps=3, replicas=2)
    [promote] = of(ctl.step(ps_exit(1)), c.PromoteBackup)
    assert promote.promotions == ((1, 2),)
    # PS 1 gone from every list. Shard 1's other backup (PS 0) may lack the last update the dead
    # primary forwarded, and the new primary numbers afresh: it catches up again from a snapshot.
    assert promote.backups == ((2,), (), (0,))
    assert promote.primary == (0, 2, 2)
    ctl.step(c.BackupPromoted(1, promote.promotions, (9,)))
    adds = of(ctl.step(c.Tick()), c.AddBackup)
    assert [(a.ps, a.shards) for a in adds] == [(0, (1,)), (1, (0, 1, 2))]  # PS 0 again; the spare: all short
    ctl.step(c.BackupAdded(0, (1,)))
    ctl.step(c.BackupAdded(1, (0, 1, 2)))
    assert ctl.replicas.backups == [[2, 1], [0, 1], [0, 1]]


def test_a_shard_that_lost_every_replica_falls_back_to_the_cut_after_the_backups_are_emptied():
    ctl, _ = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 0),), (5,)))
    decisions = of(ctl.step(ps_exit(0)), c.PromoteBackup | c.RelaunchPS)  # PS 0 led both shards: no live backup
    assert [type(d).__name__ for d in decisions] == ["PromoteBackup", "RelaunchPS"]
    assert decisions[0].fallback and decisions[0].backups == ((), ()) and decisions[0].primary == (0, 1)
    assert decisions[0].lost == (1,)  # the spare had not caught up: shard 1 has nothing to come back from
    assert decisions[1] == c.RelaunchPS(ProcessExit("ps", 0, -9, ""))  # the cut, as without replicas


def test_a_failed_promotion_falls_back_to_the_cut():
    ctl, _ = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    decisions = ctl.step(c.PromotionFailed(1, "FAILED_PRECONDITION: a command from leadership term 1 refused"))
    [fallback] = of(decisions, c.PromoteBackup)
    [relaunch] = of(decisions, c.RelaunchPS)
    assert fallback.fallback and fallback.primary == (0, 1)
    assert relaunch == c.RelaunchPS(ProcessExit("ps", 1, -9, ""))
    assert ctl.replicas.backups == [[], []] and ctl.replicas.records == []


def test_without_replicas_a_ps_death_relaunches_it_as_before():
    clock = FakeClock()
    main = TaskManager(shards(2), num_epochs=1, clock=clock, shuffle=False, task_type=TaskType.TRAINING)
    ctl = c.Controller("train", TaskDispatcher(main, None), InstanceManager(1), clock=clock)
    ctl.start()
    decisions = ctl.step(ps_exit(1))
    assert of(decisions, c.RelaunchPS) == [c.RelaunchPS(ProcessExit("ps", 1, -9, ""))]
    assert of(decisions, c.PromoteBackup) == []


def test_the_relaunched_spare_catches_up_at_a_tick_and_a_second_death_is_handled_the_same_way():
    ctl, clock = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 0),), (80,)))
    [add] = of(ctl.step(c.Tick()), c.AddBackup)
    assert add == c.AddBackup(ps=1, shards=(0, 1), primary=(0, 0), routes_version=1)
    assert of(ctl.step(c.Tick()), c.AddBackup) == []  # not asked twice while in flight
    ctl.step(c.BackupNotAdded(1, "UNAVAILABLE: not serving yet"))
    [again] = of(ctl.step(c.Tick()), c.AddBackup)
    assert again == add
    ctl.step(c.BackupAdded(1, (0, 1)))
    assert ctl.replicas.backups == [[1], [1]] and of(ctl.step(c.Tick()), c.AddBackup) == []
    # PS 0 now leads both shards, and PS 1 backs both up: both are promoted there.
    [promote] = of(ctl.step(ps_exit(0)), c.PromoteBackup)
    assert promote.promotions == ((0, 1), (1, 1)) and promote.primary == (1, 1) and not promote.fallback
    [relaunch] = of(ctl.step(c.BackupPromoted(0, promote.promotions, (90, 90))), c.RelaunchPS)
    assert relaunch.moved_to == ((0, 1),)
    assert [(r.shard, r.old_primary, r.new_primary) for r in ctl.replicas.records] == [(1, 1, 0), (0, 0, 1), (1, 0, 1)]
    assert ctl.rollbacks == []


def test_a_spare_that_dies_before_it_caught_up_is_relaunched_as_a_spare_again():
    ctl, _ = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 0),), (80,)))
    decisions = of(ctl.step(ps_exit(1)), c.PromoteBackup | c.RelaunchPS)  # it led nothing, backed up nothing
    assert [type(d).__name__ for d in decisions] == ["PromoteBackup", "RelaunchPS"]
    assert decisions[0].promotions == () and not decisions[0].fallback
    assert decisions[1].moved_to == ((1, 0),)
    assert of(ctl.step(c.Tick()), c.AddBackup) != []


pytest_plugins = ["store_fixtures"]


def test_the_roles_are_recorded_per_shard_and_replica_with_the_term_in_either_store(make_store):
    from elasticdl.master.job_state import JobState

    store = make_store()
    state = JobState.__new__(JobState)  # only its store and term are used here
    state._store, state._leadership, state.lineage = store, None, None
    roles = ReplicaRoles.initial(num_ps=3, replicas=2)
    state.record_shard_roles(roles.primary, roles.backups)
    assert store.shard_roles()[1] == {"term": 0, "replicas": {1: "primary", 2: "backup", 0: "backup"}}
    roles.ps_lost(1, now=0.0)
    state.record_shard_roles(roles.primary, roles.backups)
    assert store.shard_roles() == {
        0: {"term": 0, "replicas": {0: "primary", 2: "backup"}},
        1: {"term": 0, "replicas": {2: "primary"}},
        2: {"term": 0, "replicas": {2: "primary", 0: "backup"}},
    }


def test_a_fallback_counts_each_spare_not_caught_up_as_lost_even_when_its_shard_lives_elsewhere():
    """Seeds 185, 192, 359 of the simulator: a spare still catching up served its empty core as
    its shard after a fallback without a checkpoint. The fallback now names it lost."""
    ctl, _ = make(num_ps=3, replicas=1)
    ctl.step(ps_exit(0))
    ctl.step(c.BackupPromoted(0, ((0, 1),), (5,)))  # shard 0 on PS 1; PS 0 back as a spare
    # PS 2's shard has its only backup on the spare: no live replica. Shard 0 itself is alive on
    # PS 1, but the fallback puts every shard back on its own PS, and PS 0 holds nothing of it.
    [fallback] = of(ctl.step(ps_exit(2)), c.PromoteBackup)
    assert fallback.fallback and fallback.primary == (0, 1, 2) and fallback.lost == (0,)


def test_a_spare_that_caught_up_as_a_backup_of_its_own_shard_is_not_lost_in_a_fallback():
    ctl, _ = make(num_ps=3, replicas=1)
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 2),), (5,)))  # shard 1 on PS 2; PS 1 back as a spare
    [add] = of(ctl.step(c.Tick()), c.AddBackup)
    assert add == c.AddBackup(1, (0, 1), (0, 2, 2), 1)
    ctl.step(c.BackupAdded(1, add.shards))  # it holds shard 1 again, caught up
    ctl.step(ps_exit(0))  # shard 0 to its backup on PS 1, which does not answer
    [fallback] = of(ctl.step(c.PromotionFailed(0, "UNAVAILABLE")), c.PromoteBackup)
    assert fallback.fallback and fallback.lost == ()


def finished_with_replicas():
    """A job (no --checkpoint_dir, --ps_replicas 1 on 2 PS) whose last task is done, its model
    not saved yet."""
    from tests.test_controller import answer, make, report, take

    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1)
    ctl.replicas = ReplicaRoles.initial(num_ps=2, replicas=1)
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert dispatcher.finished and not ctl.saves_checkpoints
    return ctl


def test_after_the_last_task_without_checkpoints_a_promoted_backup_keeps_the_shard():
    ctl = finished_with_replicas()
    [promote] = of(ctl.step(ps_exit(1)), c.PromoteBackup)
    assert ctl.outcome is None and promote.promotions == ((1, 0),)
    assert of(ctl.step(c.BackupPromoted(1, promote.promotions, (4,))), c.RelaunchPS)[0].moved_to == ((1, 0),)
    assert ctl.outcome is None


def test_after_the_last_task_without_checkpoints_a_failed_promotion_fails_the_job_naming_the_fix():
    """Falling back would refill the shard from a new worker's untrained copy, exported as if
    trained (the simulator's seed 192): the job fails, as it does without replicas."""
    ctl = finished_with_replicas()
    ctl.step(ps_exit(1))
    [fail] = of(ctl.step(c.PromotionFailed(1, "UNAVAILABLE: ps-0 is not serving")), c.Fail)
    assert "ps-1 died" in fail.error and "--checkpoint_dir" in fail.error and "could not take over" in fail.error
    assert of(ctl.step(c.BackupPromoted(1, ((1, 0),), (4,))), c.RelaunchPS) == []  # it failed: nothing more


def test_after_the_last_task_without_checkpoints_a_shard_with_no_live_replica_fails_the_job():
    ctl = finished_with_replicas()
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 0),), (4,)))  # PS 0 leads both shards; PS 1 a spare, not caught up
    ctl.step(c.Tick())  # the relaunch carried out, nothing to train again: the workers get END again
    assert ctl.dispatcher.finished
    decisions = ctl.step(ps_exit(0))
    assert [type(d).__name__ for d in decisions] == ["Fail"] and "--checkpoint_dir" in decisions[0].error


def test_after_the_last_task_the_job_stays_reopened_until_the_relaunch_after_a_failed_promotion():
    """The simulator's seed 433 (checkpoints kept): the promotion failed, and the fallback's
    relaunch, which rewinds the ledger, comes one event later. In between the job ended its
    workers again, then failed with "every worker exited before the job was done"."""
    ctl = finished_with_replicas()
    ctl.saves_checkpoints = True
    ctl.step(ps_exit(1))
    assert not ctl.dispatcher.finished  # reopened: the workers get tasks again, not END
    decisions = ctl.step(c.PromotionFailed(1, "UNAVAILABLE: ps-0 is not serving"))
    assert of(decisions, c.RelaunchPS) == [c.RelaunchPS(ProcessExit("ps", 1, -9, ""))] and not of(decisions, c.Fail)
    assert not ctl.dispatcher.finished  # not ended before the relaunch (the cut's rewind) is carried out


def test_a_sync_job_ends_only_once_its_shards_are_leveled_again_after_a_ps_relaunched_at_its_end():
    """The simulator's seed 700 (sync, checkpoints kept): both PS killed after the final epoch
    end; the fallback relaunched them from the cut, nothing to train again, and the job ended
    while one still started (its shard at version 0 against 12). The end waits for the PS to
    be leveled to one version again, as the final epoch end does."""
    from tests.test_controller import answer, make, report, take

    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1, sync=True)
    ctl.replicas = ReplicaRoles.initial(num_ps=2, replicas=1)
    ctl.saves_checkpoints = True
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    answer(ctl, ctl.step(c.VersionsLeveled(12)))
    assert dispatcher.finished  # the final epoch end was read: the workers get END
    ctl.step(ps_exit(0))
    ctl.step(c.PromotionFailed(0, "UNAVAILABLE: ps-1 is not serving"))
    ctl.step(c.PSRelaunched(0, restored_version=12))
    assert of(ctl.step(c.Tick()), c.LevelVersions) == [c.LevelVersions()]
    assert not dispatcher.finished and ctl.outcome is None
    assert of(ctl.step(c.VersionsNotLeveled()), c.Finish) == []  # the relaunched PS does not serve yet
    assert not dispatcher.finished
    ctl.step(c.Tick())
    ctl.step(c.VersionsLeveled(12))
    assert dispatcher.finished


def test_a_spare_caught_up_on_some_shards_is_asked_again_for_the_others_only():
    """A catch-up that failed after some shards (a sync average refused the next one's snapshot):
    the shards caught up count as backed up, and the next AddBackup asks for the rest only. Asked
    for all of them again, the executor prepared a caught-up shard afresh, dropping the backup its
    primary forwarded to: the pushes then held the sync average that refused the other snapshot,
    at every Tick (the livelock of test_e2e_replicas under load)."""
    ctl, _ = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 0),), (80,)))
    [add] = of(ctl.step(c.Tick()), c.AddBackup)
    assert add.shards == (0, 1)
    ctl.step(c.BackupAdded(1, (0,), complete=False))
    ctl.step(c.BackupNotAdded(1, "FAILED_PRECONDITION: 1 gradients wait in the sync average"))
    assert ctl.replicas.backups == [[1], []]
    [again] = of(ctl.step(c.Tick()), c.AddBackup)
    assert again.ps == 1 and again.shards == (1,)
    ctl.step(c.BackupAdded(1, (1,)))
    assert ctl.replicas.backups == [[1], [1]] and of(ctl.step(c.Tick()), c.AddBackup) == []
