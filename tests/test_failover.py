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
    assert promote.backups == ((2,), (0,), (0,))  # PS 1 gone from every list; shard 1's new primary off its own
    assert promote.primary == (0, 2, 2)


def test_a_shard_that_lost_every_replica_falls_back_to_the_cut_after_the_backups_are_emptied():
    ctl, _ = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    ctl.step(c.BackupPromoted(1, ((1, 0),), (5,)))
    decisions = of(ctl.step(ps_exit(0)), c.PromoteBackup | c.RelaunchPS)  # PS 0 led both shards: no live backup
    assert [type(d).__name__ for d in decisions] == ["PromoteBackup", "RelaunchPS"]
    assert decisions[0].promotions == () and decisions[0].backups == ((), ())
    assert decisions[1] == c.RelaunchPS(ProcessExit("ps", 0, -9, ""))  # the cut, as without replicas


def test_a_failed_promotion_falls_back_to_the_cut():
    ctl, _ = make(num_ps=2, replicas=1)
    ctl.step(ps_exit(1))
    [relaunch] = of(ctl.step(c.PromotionFailed(1, "FAILED_PRECONDITION: a command from leadership term 1 refused")),
                    c.RelaunchPS)
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
