"""The master's controller, driven event by event: no processes, no sleeps, a fake clock."""

from __future__ import annotations

import pytest

from elasticdl.data.errors import BadRecord, BadRecordError
from elasticdl.data.sources import Shard
from elasticdl.errors import TrainingDivergedError
from elasticdl.launch.api import ProcessExit
from elasticdl.master import controller as c
from elasticdl.master.evaluation_service import EvaluationService, TaskDispatcher
from elasticdl.master.feed import FeedLivelock, feed
from elasticdl.master.instance_manager import InstanceManager, Launch, Priority, Stop
from elasticdl.master.task_manager import NoTask, Task, TaskManager, TaskType


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePS:
    """Answers TakeSnapshot as the job does: the version it froze, or a failure while restarting."""

    def __init__(self):
        self.version = 0
        self.down = False
        self.snapshots: list[int] = []

    def answer(self, decision: c.TakeSnapshot):
        if self.down:
            return c.SnapshotFailed(decision.round_id, "connection refused")
        self.snapshots.append(decision.round_id)
        return c.SnapshotTaken(decision.round_id, self.version)


def answering_snapshots(ctl: c.Controller, ps: FakePS) -> c.Controller:
    """The controller's step, with each TakeSnapshot answered at once (as the job's feed does);
    the returned decisions include those the answers led to."""
    step = ctl.step

    def step_and_answer(event):
        decisions = step(event)
        for decision in list(decisions):
            if isinstance(decision, c.TakeSnapshot):
                decisions += step_and_answer(ps.answer(decision))
        return decisions

    ctl.step = step_and_answer
    return ctl


def shards(tasks: int, records: int = 10) -> list[Shard]:
    return [Shard("data.rec", i * records, (i + 1) * records) for i in range(tasks)]


def make(command="train", workers=2, epochs=2, tasks=2, evaluation_steps=0, with_eval=False, sync=False,
         relaunch_limit=3, max_ps_relaunches=3, max_bad_records=0, max_task_retries=3, waits=False,
         task_timeout=600.0, fences=False):
    clock = FakeClock()
    ps = FakePS()
    main = None
    if command in ("train", "predict"):
        main = TaskManager(shards(tasks), num_epochs=epochs if command == "train" else 1, clock=clock,
                           shuffle=False, task_type=TaskType.TRAINING if command == "train" else TaskType.PREDICTION,
                           max_task_retries=max_task_retries, gate_epochs=command == "train",
                           task_timeout=task_timeout, fences_pushes=fences)
    evaluation = None
    if with_eval or command == "evaluate":
        evaluation = EvaluationService(shards(1), metrics_fn=dict, evaluation_steps=evaluation_steps, clock=clock,
                                       max_task_retries=max_task_retries)
    dispatcher = TaskDispatcher(main, evaluation)
    ctl = c.Controller(command, dispatcher, InstanceManager(workers, relaunch_limit=relaunch_limit),
                       sync_mode=sync, evaluation_steps=evaluation_steps, max_ps_relaunches=max_ps_relaunches,
                       clock=clock, max_bad_records=max_bad_records, wait_for_epoch_callbacks=waits)
    return answering_snapshots(ctl, ps), dispatcher, ps, clock


def kinds(decisions) -> list[str]:
    return [type(d).__name__ for d in decisions]


def of(decisions, kind) -> list:
    return [d for d in decisions if isinstance(d, kind)]


def take(dispatcher: TaskDispatcher, worker: int) -> Task:
    task = dispatcher.get_task(worker)
    assert isinstance(task, Task), task
    return task


def report(ctl: c.Controller, dispatcher: TaskDispatcher, task: Task, worker: int, err: str = "") -> list:
    outcome = dispatcher.report(task.task_id, worker, err, 0 if err else task.shard.end - task.shard.start, {})
    return ctl.step(c.TaskReported(task.task_id, worker, outcome.accepted))


def exit_of(index: int, code: int = 0, role: str = "worker", tail: str = "") -> c.RoleExited:
    return c.RoleExited(ProcessExit(role, index, code, tail))


def answer(ctl: c.Controller, decisions) -> list:
    """Carry out the decisions the way the job does: EndEpoch is answered by EpochEnded,
    FireEpochEnd by EpochEndFired, and OpenEpoch opens the epoch in the ledger."""
    out = []
    for decision in decisions:
        if isinstance(decision, c.EndEpoch):
            out += answer(ctl, ctl.step(c.EpochEnded(decision.epoch)))
        elif isinstance(decision, c.FireEpochEnd):
            out += answer(ctl, ctl.step(c.EpochEndFired(decision.epoch)))
        elif isinstance(decision, c.OpenEpoch):
            ctl.tasks.open_epoch(decision.epoch)
    return list(decisions) + out


def train_epoch(ctl, dispatcher, worker=0) -> list:
    decisions = []
    while True:
        task = dispatcher.get_task(worker)
        if not isinstance(task, Task) or task.type != TaskType.TRAINING:
            return decisions
        decisions += answer(ctl, report(ctl, dispatcher, task, worker))
        if of(decisions, c.EndEpoch):
            return decisions


# ---------------------------------------------------------------- training, no evaluation


def test_start_launches_the_initial_workers():
    ctl, _, _, _ = make(workers=3)
    assert ctl.start() == [Launch(0, Priority.HIGH), Launch(1, Priority.HIGH), Launch(2, Priority.HIGH)]
    assert ctl.workers == {0, 1, 2}


def test_an_epoch_end_fires_callbacks_then_the_next_epoch_begins():
    ctl, dispatcher, _, _ = make(workers=1, epochs=2)
    ctl.start()
    first = take(dispatcher, 0)
    assert of(report(ctl, dispatcher, first, 0), c.EndEpoch) == []  # one task of two: no epoch end yet
    second = take(dispatcher, 0)
    decisions = report(ctl, dispatcher, second, 0)
    # Epoch 0 ends with its last report; epoch 1's tasks wait until the master opens it.
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=False, sync_model=True)]
    assert dispatcher.get_task(0) is NoTask.WAIT
    assert of(ctl.step(c.Tick()), c.EndEpoch) == []  # not asked twice
    assert ctl.step(c.EpochEnded(0)) == [c.FireEpochEnd(0), c.FireEpochBegin(1), c.OpenEpoch(1)]
    assert ctl.epoch_done == 0
    ctl.tasks.open_epoch(1)
    assert take(dispatcher, 0).epoch == 1


def test_the_job_finishes_when_the_last_epoch_ended_and_every_worker_left():
    ctl, dispatcher, _, _ = make(workers=2, epochs=1)
    ctl.start()
    decisions = []
    for worker in (0, 1):
        decisions += answer(ctl, report(ctl, dispatcher, take(dispatcher, worker), worker))
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]
    assert of(decisions, c.FireEpochEnd) == [c.FireEpochEnd(0)]
    assert of(decisions, c.FireEpochBegin) == []  # no epoch after the last
    assert dispatcher.finished  # workers now get END
    assert of(ctl.step(exit_of(0)), c.Finish) == []  # one worker still running
    assert ctl.step(exit_of(1)) == [c.Finish()]
    assert ctl.step(c.Tick()) == []  # decided: nothing more
    assert ctl.instances.relaunches == 0 and ctl.instances.preemptions == 0


def test_a_frozen_worker_is_replaced_once_its_task_times_out_even_when_nobody_else_asks():
    """Issue 25: a SIGSTOPped worker held the job open forever. Its only task timed out, but a
    timeout was only noticed when another worker asked for a task, and none did."""
    ctl, dispatcher, _, clock = make(workers=1, epochs=1, tasks=1, task_timeout=5.0)
    ctl.start()
    task = take(dispatcher, 0)
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == []
    clock.now += 6.0
    decisions = ctl.step(c.Tick())
    assert of(decisions, c.ReplaceWorker) == [c.ReplaceWorker(0, "its task timed out (--task_timeout)")]
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == []  # asked once
    assert of(ctl.step(exit_of(0, code=-9)), Launch) == [Launch(1, Priority.HIGH)]  # its slot refilled
    again = take(dispatcher, 1)
    assert (again.task_id, again.shard) == (task.task_id, task.shard)
    answer(ctl, report(ctl, dispatcher, again, 1))
    assert ctl.step(exit_of(1)) == [c.Finish()]
    assert ctl.instances.relaunches == 0  # a replacement is not a crash


def test_a_worker_that_does_not_leave_after_the_end_is_killed_instead_of_holding_the_job_open():
    ctl, dispatcher, _, clock = make(workers=2, epochs=1, tasks=1)
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert dispatcher.finished
    assert of(ctl.step(exit_of(0)), c.Finish) == []  # worker 1 is frozen: it never asks again
    clock.now += c.WORKERS_LEAVE_SECONDS / 2
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == []
    clock.now += c.WORKERS_LEAVE_SECONDS
    assert [d.index for d in of(ctl.step(c.Tick()), c.ReplaceWorker)] == [1]
    assert ctl.step(exit_of(1, code=-9)) == [c.Finish()]  # no refill: the job is over


def test_a_dead_workers_hand_out_is_fenced_by_a_decision_and_its_rest_requeued_on_the_answer():
    """The ledger never calls a PS: a task taken back waits for FenceHandouts' answer."""
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1, fences=True)
    ctl.start()
    task = take(dispatcher, 0)
    decisions = ctl.step(exit_of(0, code=-9))
    assert of(decisions, c.FenceHandouts) == [c.FenceHandouts((task.handout,), (task.task_id,))]
    assert of(ctl.step(c.Tick()), c.FenceHandouts) == []  # asked once
    assert dispatcher.get_task(1) is NoTask.WAIT  # not handed out before it is fenced
    ctl.step(c.HandoutsFenced((task.handout,), {task.task_id: task.shard.start + 4}))
    again = take(dispatcher, 1)
    assert (again.task_id, again.shard.start) == (task.task_id, task.shard.start + 4)


def test_a_ps_silent_past_the_deadline_is_killed_once_and_then_relaunched_like_a_dead_one():
    """A frozen PS (SIGSTOP) is not dead: no exit comes. It answers no probe, and is replaced."""
    ctl, dispatcher, _, clock = make(workers=1, epochs=1, tasks=2)
    ctl.start()
    take(dispatcher, 0)
    assert of(ctl.step(c.PSSilent((1,))), c.ReplacePS) == []
    clock.now += c.PS_SILENT_SECONDS / 2
    assert of(ctl.step(c.PSSilent(())), c.ReplacePS) == []  # it answered: the silence starts over
    assert of(ctl.step(c.PSSilent((1,))), c.ReplacePS) == []
    clock.now += c.PS_SILENT_SECONDS - 1
    assert of(ctl.step(c.PSSilent((1,))), c.ReplacePS) == []
    clock.now += 1
    (replace,) = of(ctl.step(c.PSSilent((1,))), c.ReplacePS)
    assert replace.index == 1 and "answered no probe for 60 s" in replace.reason
    clock.now += 10
    assert of(ctl.step(c.PSSilent((1,))), c.ReplacePS) == []  # killed once; its exit is coming
    assert of(ctl.step(exit_of(1, code=-9, role="ps")), c.RelaunchPS) == [c.RelaunchPS(ProcessExit("ps", 1, -9, ""))]


def test_the_probe_names_the_ps_that_did_not_answer_in_time_and_reports_the_version_when_all_did():
    import grpc

    from elasticdl.master.ps_probe import PSProbe

    class Future:
        def __init__(self, answer):
            self.answer = answer

        def done(self):
            return True

        def result(self):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    class Late(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    from elasticdl.proto import elasticdl_pb2

    class FakeClient:
        answers: list = []

        def stats_futures(self, timeout):
            return [Future(a) for a in self.answers]

    client, clock = FakeClient(), FakeClock()
    probe = PSProbe(client, interval=0.5, clock=clock)
    client.answers = [elasticdl_pb2.PSStats(version=7), Late()]
    assert probe.poll() == []  # asked
    assert probe.poll() == [c.PSSilent((1,))]  # answered: PS 1 is silent, no version
    clock.now += 0.5
    client.answers = [elasticdl_pb2.PSStats(version=7), Down()]
    probe.poll()
    assert probe.poll() == [c.PSSilent(())]  # a PS that is down is not silent: its exit tells
    clock.now += 0.5
    client.answers = [elasticdl_pb2.PSStats(version=9), elasticdl_pb2.PSStats(version=8)]
    probe.poll()
    assert probe.poll() == [c.PSSilent(()), c.VersionReported(8)]


def test_the_job_goes_through_named_phases():
    ctl, dispatcher, ps, _ = make(workers=1, epochs=1, tasks=1, with_eval=True)
    ctl.start()
    assert ctl.phase is c.Phase.RUNNING
    ctl.step(c.TaskReported(0, 0, dispatcher.report(take(dispatcher, 0).task_id, 0, "", 10, {}).accepted))
    assert ctl.phase is c.Phase.ENDING_EPOCH  # EndEpoch is out, its answer not back
    ctl.step(c.EpochEnded(0))
    assert ctl.phase is c.Phase.FINAL_EVALUATION
    run_round(ctl, dispatcher)
    assert ctl.phase is c.Phase.LEAVING and dispatcher.finished
    ctl.step(exit_of(0))
    assert ctl.phase is c.Phase.FINISHED
    assert ctl.phases == [c.Phase.RUNNING, c.Phase.ENDING_EPOCH, c.Phase.FINAL_EVALUATION, c.Phase.LEAVING,
                          c.Phase.FINISHED]  # each once, however many epochs


def test_a_deferred_epoch_end_is_asked_again_at_the_next_tick():
    """Not at once: the job feeds an event's follow-ups before it polls the roles again, so an
    end asked again at once, deferred again by the PS that is down, kept it from ever seeing
    that PS's exit (found by a PS SIGKILL at an epoch's end, with --tensor_transport tcp)."""
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1)
    ctl.start()
    end = of(report(ctl, dispatcher, take(dispatcher, 0), 0), c.EndEpoch)
    assert end == [c.EndEpoch(0, final=True, sync_model=True)]
    assert of(ctl.step(c.EpochEndDeferred(0)), c.EndEpoch) == []  # not at once
    assert of(ctl.step(c.VersionReported(3)), c.EndEpoch) == []  # nor at another event
    assert of(ctl.step(exit_of(0, role="ps")), c.RelaunchPS) != []  # the PS's exit is seen
    assert of(ctl.step(c.Tick()), c.EndEpoch) == end  # asked again at the next poll
    assert ctl.epoch_done == -1 and not dispatcher.finished
    ctl.step(c.EpochEndDeferred(0))
    assert of(ctl.step(c.Tick()), c.EndEpoch) == end
    assert of(ctl.step(c.EpochEnded(0)), c.FireEpochEnd) == [c.FireEpochEnd(0)]
    assert dispatcher.finished


def test_a_stray_epoch_ended_does_not_skip_an_epoch():
    ctl, dispatcher, _, _ = make(workers=1, epochs=2, tasks=1)
    ctl.start()
    assert of(ctl.step(c.EpochEnded(1)), c.FireEpochEnd) == []
    assert ctl.epoch_done == -1


def test_save_ledger_only_when_the_ledger_moved():
    ctl, dispatcher, _, _ = make(workers=1)
    ctl.start()
    assert of(ctl.step(c.Tick()), c.SaveLedger) == [c.SaveLedger()]
    assert of(ctl.step(c.Tick()), c.SaveLedger) == []
    take(dispatcher, 0)
    assert of(ctl.step(c.Tick()), c.SaveLedger) == [c.SaveLedger()]


def test_sync_mode_tells_the_ps_how_many_workers_hold_a_task():
    ctl, dispatcher, _, _ = make(workers=2, sync=True, tasks=4)
    ctl.start()
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []  # nobody holds a task yet
    take(dispatcher, 0)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(1)]
    take(dispatcher, 1)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(2)]
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []
    # A PS was away: told again at the next Tick, not at once (that was a livelock, below).
    assert of(ctl.step(c.LiveWorkersNotTold()), c.TellLiveWorkers) == []
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(2)]


def test_a_feed_settles_while_a_ps_is_away_so_the_job_gets_back_to_polling_exits():
    """Issue 25's livelock: a worker died while a dead PS's exit was not polled yet. Each tell
    found the PS away, and the controller told again at once inside the same feed, forever."""
    ctl, dispatcher, _, clock = make(workers=2, sync=True, tasks=4)
    ctl.start()
    take(dispatcher, 0), take(dispatcher, 1)
    told = []

    def carry_out(decision):  # the PS is dead and its exit not polled: every tell fails
        if isinstance(decision, c.TellLiveWorkers):
            told.append(decision.count)
            return [c.LiveWorkersNotTold()]
        return []

    assert feed(ctl, c.RoleExited(ProcessExit("worker", 0, -9, "")), carry_out) <= 3
    assert told == [1]  # one attempt, then the feed ends: the job polls the exits again
    clock.now += c.LIVE_WORKERS_SETTLE_SECONDS
    assert feed(ctl, c.Tick(), carry_out) <= 3
    assert told == [1, 1]  # and one more at every Tick


def test_a_controller_that_answers_itself_forever_fails_the_feed_instead_of_spinning():
    class Echo:  # a controller that decides something at every event, forever
        outcome = None

        def step(self, event):
            return [c.SaveLedger()]

    with pytest.raises(FeedLivelock, match="took 50 events without settling"):
        feed(Echo(), c.Tick(), lambda decision: [c.Tick()], max_steps=50)


def test_sync_mode_tells_the_ps_of_fewer_workers_only_once_the_dip_lasted():
    ctl, dispatcher, _, clock = make(workers=2, sync=True, tasks=6)
    ctl.start()
    first, second = take(dispatcher, 0), take(dispatcher, 1)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(2)]
    # Worker 0 reports and fetches its next task a moment later: not a worker gone.
    assert of(report(ctl, dispatcher, first, 0), c.TellLiveWorkers) == []
    clock.now += c.LIVE_WORKERS_SETTLE_SECONDS / 2
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []
    take(dispatcher, 0)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []
    # Worker 1 reports and holds nothing for longer: the PS stop waiting for it.
    report(ctl, dispatcher, second, 1)
    clock.now += c.LIVE_WORKERS_SETTLE_SECONDS / 2
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []  # the earlier dip ended: counted anew
    clock.now += c.LIVE_WORKERS_SETTLE_SECONDS / 2
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(1)]
    take(dispatcher, 1)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(2)]  # more: at once


def test_sync_mode_tells_the_ps_when_nobody_holds_a_task_any_more_so_pending_gradients_apply():
    """Found by the simulator (seed 601): with grads_to_wait 3, the workers' last pushes waited in
    the PS's average for pushes that never came; the ledger counted their records done, the
    model never got them, and the PS were never told that nobody was left."""
    ctl, dispatcher, _, clock = make(workers=2, sync=True, tasks=4, epochs=1)
    ctl.start()
    first, second = take(dispatcher, 0), take(dispatcher, 1)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == [c.TellLiveWorkers(2)]
    report(ctl, dispatcher, first, 0)
    report(ctl, dispatcher, second, 1)
    clock.now += c.LIVE_WORKERS_SETTLE_SECONDS * 10
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []  # between tasks: the next pushes complete it
    # The last tasks: told 0 at once when they are reported, before the epoch's (final) end.
    third, fourth = take(dispatcher, 0), take(dispatcher, 1)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []
    report(ctl, dispatcher, third, 0)
    decisions = report(ctl, dispatcher, fourth, 1)
    assert kinds(decisions).index("TellLiveWorkers") < kinds(decisions).index("LevelVersions")
    assert of(decisions, c.TellLiveWorkers) == [c.TellLiveWorkers(0)]
    # A PS was away for that tell: told again at the next Tick (simulator, seed 260).
    assert of(ctl.step(c.LiveWorkersNotTold()), c.TellLiveWorkers) == []
    assert of(ctl.step(c.VersionsNotLeveled()), c.LevelVersions) == []
    assert kinds(ctl.step(c.Tick()))[:2] == ["TellLiveWorkers", "LevelVersions"]
    assert of(ctl.step(c.VersionsLeveled(9)), c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]


def test_sync_mode_levels_the_shards_to_one_version_before_the_final_epoch_end():
    """Issue 25: every shard of a sync job ends at one version, whatever grads_to_wait is. After
    faults the shards group the same gradients into versions differently (the simulator: seeds
    555, 965, 4788, ...), so once training is over and 0 live workers were told the controller
    decides LevelVersions, and reads the final model (EndEpoch) only once it was answered."""
    ctl, dispatcher, _, clock = make(workers=1, sync=True, tasks=2, epochs=1)
    ctl.start()
    assert of(report(ctl, dispatcher, take(dispatcher, 0), 0), c.LevelVersions) == []  # training goes on
    decisions = report(ctl, dispatcher, take(dispatcher, 0), 0)
    assert of(decisions, c.LevelVersions) == [c.LevelVersions()] and of(decisions, c.EndEpoch) == []
    assert of(ctl.step(c.VersionsNotLeveled()), c.LevelVersions) == []  # a PS away: not at once
    assert of(ctl.step(c.VersionReported(7)), c.EndEpoch) == []  # the end waits for the leveling
    assert of(ctl.step(c.Tick()), c.LevelVersions) == [c.LevelVersions()]
    decisions = ctl.step(c.VersionsLeveled(9))
    assert of(decisions, c.VersionChanged) == [c.VersionChanged(9)]
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]
    assert of(ctl.step(c.Tick()), c.LevelVersions) == []  # once
    # A PS relaunched before the end: it may come back at another version, leveled again.
    assert of(ctl.step(exit_of(0, role="ps")), c.RelaunchPS) != []
    assert of(ctl.step(c.Tick()), c.LevelVersions) == [c.LevelVersions()]


def test_async_mode_never_tells_live_workers():
    ctl, dispatcher, _, _ = make(workers=1, sync=False)
    ctl.start()
    take(dispatcher, 0)
    assert of(ctl.step(c.Tick()), c.TellLiveWorkers) == []


def test_versions_are_monotone_and_each_new_one_is_announced():
    ctl, _, _, _ = make()
    ctl.start()
    assert of(ctl.step(c.VersionReported(5)), c.VersionChanged) == [c.VersionChanged(5)]
    assert of(ctl.step(c.VersionReported(5)), c.VersionChanged) == []
    assert of(ctl.step(c.VersionReported(3)), c.VersionChanged) == []  # a PS restored from a checkpoint
    assert ctl.model_version == 5


def test_stop_requested_drops_the_tasks_not_started():
    ctl, dispatcher, _, _ = make(workers=1, epochs=3, tasks=3)
    ctl.start()
    task = take(dispatcher, 0)
    ctl.step(c.StopRequested("EarlyStopping: accuracy did not improve"))
    ctl.step(c.StopRequested("another reason"))
    assert ctl.stop_reason == "EarlyStopping: accuracy did not improve"
    decisions = answer(ctl, report(ctl, dispatcher, task, 0))
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]
    assert dispatcher.finished
    assert ctl.step(exit_of(0)) == [c.Finish()]


# ---------------------------------------------------------------- workers come and go


def test_a_crashed_worker_is_relaunched_with_a_new_index_and_its_task_requeued():
    ctl, dispatcher, _, _ = make(workers=1)
    ctl.start()
    task = take(dispatcher, 0)
    decisions = ctl.step(exit_of(0, code=1, tail="Traceback\nValueError: boom"))
    assert of(decisions, Launch) == [Launch(1, Priority.HIGH)]
    assert ctl.workers == {1}
    assert take(dispatcher, 1).task_id == task.task_id
    assert ctl.instances.relaunches == 1


def test_a_worker_crashing_past_the_relaunch_limit_fails_the_job_with_its_log():
    ctl, _, _, _ = make(workers=1, relaunch_limit=1)
    ctl.start()
    ctl.step(exit_of(0, code=1))
    decisions = ctl.step(exit_of(1, code=1, tail="ValueError: boom"))
    assert kinds(decisions) == ["Fail"]
    assert "crashed 2 times" in decisions[0].error and "ValueError: boom" in decisions[0].error
    assert ctl.outcome == decisions[0]


def test_a_preempted_worker_is_replaced_without_counting_a_crash():
    ctl, _, _, _ = make(workers=2)
    ctl.start()
    assert of(ctl.step(exit_of(1, code=-9)), Launch) == [Launch(2, Priority.HIGH)]
    assert ctl.instances.preemptions == 1 and ctl.instances.relaunches == 0


def test_every_worker_gone_before_the_job_is_done_fails_with_the_first_failure():
    ctl, _, _, _ = make(workers=1, relaunch_limit=0)
    ctl.start()
    decisions = ctl.step(exit_of(0, code=2, tail="ImportError: no module named zoo"))
    assert kinds(decisions) == ["Fail"]


def test_scaled_to_zero_the_job_waits_then_grows_again():
    ctl, dispatcher, _, _ = make(workers=2)
    ctl.start()
    assert of(ctl.step(c.ScaleRequested(0)), Stop) == [Stop(1), Stop(0)]
    assert of(ctl.step(exit_of(0)), c.Fail) == []
    assert of(ctl.step(exit_of(1)), c.Fail) == []  # desired 0: not a failure
    assert ctl.workers == set() and ctl.outcome is None
    assert of(ctl.step(c.ScaleRequested(1)), Launch) == [Launch(2, Priority.HIGH)]
    assert ctl.workers == {2}


# ---------------------------------------------------------------- parameter servers and the store


def test_a_dead_ps_is_relaunched_up_to_the_limit():
    ctl, _, _, _ = make(max_ps_relaunches=2)
    ctl.start()
    ps_exit = exit_of(0, code=-9, role="ps")
    assert ctl.step(ps_exit)[:1] == [c.RelaunchPS(ps_exit.exit)]
    assert ctl.step(ps_exit)[:1] == [c.RelaunchPS(ps_exit.exit)]
    decisions = ctl.step(ps_exit)
    assert kinds(decisions) == ["Fail"] and "ps-0 died" in decisions[0].error
    assert ctl.ps_relaunches == 3


def test_a_relaunched_ps_is_recorded_as_a_rollback_from_the_version_the_job_had_reached():
    ctl, _, _, _ = make()
    ctl.start()
    ctl.step(c.VersionReported(120))
    ctl.step(exit_of(0, code=-9, role="ps"))
    ctl.step(c.PSRelaunched(0, restored_version=80, retrained=640))
    ctl.step(exit_of(1, code=-9, role="ps"))
    ctl.step(c.PSRelaunched(1, restored_version=None, missing=96))
    assert [r.to_dict() for r in ctl.rollbacks] == [
        {"ps": 0, "from_version": 120, "to_version": 80, "records_retrained": 640, "records_possibly_missing": 0},
        {"ps": 1, "from_version": 120, "to_version": None, "records_retrained": 0, "records_possibly_missing": 96},
    ]


def test_a_ps_lost_after_the_last_task_reopens_the_job_until_the_model_is_saved():
    """The PS holds the only copy of what was trained since the last cut: a PS dying while the
    workers leave is relaunched as during training, and the workers come back to retrain what
    the recovery rolls back."""
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1)
    ctl.saves_checkpoints = True  # --checkpoint_dir: the dead PS comes back from a cut
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert dispatcher.finished
    decisions = ctl.step(exit_of(0, code=-9, role="ps"))
    assert of(decisions, c.RelaunchPS) and ctl.ps_relaunches == 1
    assert not dispatcher.finished  # workers get tasks again, not END
    # Worker 0 leaves on the END it got before: its slot is filled again, not a preemption.
    assert of(ctl.step(exit_of(0, code=0)), Launch) == [Launch(1, Priority.HIGH)]
    assert ctl.instances.preemptions == 0


def test_a_ps_lost_after_finish_reopens_the_job_and_starts_the_workers_that_left():
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1)
    ctl.saves_checkpoints = True  # --checkpoint_dir: the dead PS comes back from a cut
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert kinds(ctl.step(exit_of(0, code=0))) == ["Finish"]
    assert ctl.reopen_after_finish() and ctl.outcome is None
    decisions = ctl.step(exit_of(0, code=-9, role="ps"))
    assert of(decisions, c.RelaunchPS) and of(decisions, Launch) == [Launch(1, Priority.HIGH)]
    assert ctl.phase != c.Phase.FINISHED and not dispatcher.finished  # the recovery rewinds the ledger


def test_a_ps_lost_after_the_last_task_without_checkpoints_fails_the_job_naming_the_fix():
    """Nothing to come back from: the workers that held a copy of the model left. A relaunched
    empty PS would be refilled with an untrained copy and exported as if trained."""
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1)
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    (fail,) = ctl.step(exit_of(1, code=-9, role="ps"))
    assert isinstance(fail, c.Fail) and "ps-1 died" in fail.error and "--checkpoint_dir" in fail.error


def test_evaluate_and_predict_do_not_reopen_for_a_ps_lost_at_their_end():
    ctl, dispatcher, _, _ = make(command="predict", workers=1, tasks=1)
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert ctl.step(exit_of(0, code=-9, role="ps")) == []  # the predictions are written
    assert kinds(ctl.step(exit_of(0, code=0))) == ["Finish"]
    assert not ctl.reopen_after_finish()


def test_evaluate_and_predict_never_relaunch_a_ps():
    ctl, _, _, _ = make(command="predict", workers=1)
    ctl.start()
    assert kinds(ctl.step(exit_of(0, code=-9, role="ps"))) == ["Fail"]


def test_a_lost_store_fails_the_job_and_nothing_follows():
    ctl, _, _, _ = make()
    ctl.start()
    decisions = ctl.step(c.StoreLost("lost the leader lock: lease expired"))
    assert kinds(decisions) == ["Fail"] and "lease expired" in decisions[0].error
    assert ctl.step(c.Tick()) == [] and ctl.step(exit_of(0)) == []


# ---------------------------------------------------------------- evaluation


def run_round(ctl, dispatcher, worker=0) -> list:
    """Run every task of the current evaluation round on ``worker``."""
    decisions = []
    while True:
        task = dispatcher.get_task(worker)
        if not isinstance(task, Task) or task.type != TaskType.EVALUATION:
            return decisions
        decisions += answer(ctl, report(ctl, dispatcher, task, worker))


def test_a_version_report_starts_a_round_every_n_versions_without_waiting_for_a_poll():
    ctl, dispatcher, ps, _ = make(workers=1, epochs=2, tasks=4, evaluation_steps=15, with_eval=True)
    ctl.start()
    ps.version = 14
    ctl.step(c.VersionReported(14))
    assert not ctl.evaluation.busy
    ps.version = 15
    ctl.step(c.VersionReported(15))
    assert ctl.evaluation.busy and ctl.evaluation.current.reason == "every 15 versions"
    assert ctl.evaluation.current.model_version == 15
    decisions = run_round(ctl, dispatcher)
    assert kinds(decisions).count("RecordEvaluation") == 1
    assert of(decisions, c.FireEpochEnd) == []  # not an epoch's round: no callbacks
    assert of(decisions, c.DropSnapshot) == [c.DropSnapshot(1)]


def test_epoch_end_rounds_queue_behind_a_running_round_and_fire_callbacks_on_their_snapshot():
    ctl, dispatcher, ps, _ = make(workers=2, epochs=2, tasks=1, evaluation_steps=5, with_eval=True)
    ctl.start()
    training = take(dispatcher, 0)
    ps.version = 5
    ctl.step(c.VersionReported(5))  # a versions round takes the evaluator
    assert ctl.evaluation.current.reason == "every 5 versions"
    evaluation_task = take(dispatcher, 1)
    assert evaluation_task.type == TaskType.EVALUATION
    ps.version = 6
    decisions = answer(ctl, report(ctl, dispatcher, training, 0))  # epoch 0 is complete
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=False, sync_model=False)]
    assert of(decisions, c.FireEpochBegin) == [c.FireEpochBegin(1)]
    assert of(decisions, c.FireEpochEnd) == []  # after its round
    assert ps.snapshots == [1, 2]  # the epoch's snapshot is taken at its end, not when its round starts
    assert ctl.evaluation.current.round_id == 1  # the epoch's round waits
    take(dispatcher, 0)  # epoch 1 trains meanwhile
    ps.version = 7
    decisions = report(ctl, dispatcher, evaluation_task, 1)
    assert of(decisions, c.DropSnapshot) == [c.DropSnapshot(1)]
    assert ctl.evaluation.current.reason == "epoch 1" and ctl.evaluation.current.model_version == 6
    decisions = run_round(ctl, dispatcher, worker=1)
    assert of(decisions, c.FireEpochEnd) == [c.FireEpochEnd(0, {}, snapshot=2)]
    assert of(decisions, c.DropSnapshot) == [c.DropSnapshot(2)]


def test_with_early_stopping_the_next_epoch_waits_for_the_epochs_callbacks():
    ctl, dispatcher, ps, _ = make(workers=1, epochs=3, tasks=1, with_eval=True, waits=True)
    ctl.start()
    decisions = answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert of(decisions, c.FireEpochBegin) == [] and of(decisions, c.OpenEpoch) == []
    evaluation_task = take(dispatcher, 0)
    assert evaluation_task.type == TaskType.EVALUATION
    assert dispatcher.get_task(0) is NoTask.WAIT  # epoch 1 is not open: the callbacks did not see epoch 0
    decisions = report(ctl, dispatcher, evaluation_task, 0)  # the round's only task
    assert of(decisions, c.FireEpochEnd) == [c.FireEpochEnd(0, {}, snapshot=1)]
    assert of(decisions, c.OpenEpoch) == []
    # The job answers FireEpochEnd once the callbacks ran; the next epoch opens only then.
    assert ctl.step(c.EpochEndFired(0)) == [c.FireEpochBegin(1), c.OpenEpoch(1)]
    ctl.tasks.open_epoch(1)
    training = take(dispatcher, 0)
    assert training.epoch == 1
    answer(ctl, report(ctl, dispatcher, training, 0))
    decisions = report(ctl, dispatcher, take(dispatcher, 0), 0)
    assert of(decisions, c.FireEpochEnd) == [c.FireEpochEnd(1, {}, snapshot=2)]
    ctl.step(c.StopRequested("EarlyStopping: accuracy has not improved for 1 epoch"))  # the callback's answer
    assert of(ctl.step(c.EpochEndFired(1)), c.OpenEpoch) == []  # stopped: epoch 2 never opens
    assert ctl.tasks.finished and len(ctl.tasks.epochs) == 2


def test_the_job_waits_for_the_final_round_before_workers_get_end():
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1, with_eval=True)
    ctl.start()
    decisions = answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert of(decisions, c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=False)]
    assert ctl.evaluation.current.reason == "final"
    assert not dispatcher.finished  # the final round still needs the workers
    decisions = run_round(ctl, dispatcher)
    assert of(decisions, c.FireEpochEnd) == [c.FireEpochEnd(0, {}, snapshot=1)]
    assert dispatcher.finished
    assert ctl.step(exit_of(0)) == [c.Finish()]


def test_a_ps_restart_during_a_round_runs_it_again_on_a_fresh_snapshot():
    ctl, dispatcher, ps, _ = make(workers=1, epochs=1, tasks=1, with_eval=True)
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert ctl.evaluation.current.round_id == 1
    ps.down = True
    assert ctl.step(exit_of(0, code=-9, role="ps"))[:1] == [c.RelaunchPS(ProcessExit("ps", 0, -9, ""))]
    assert ctl.evaluation.current.suspended
    assert dispatcher.get_task(0).__class__ is not Task  # no tasks of a suspended round
    decisions = ctl.step(c.Tick())  # the PS is not serving yet: the snapshot fails
    failed = of(decisions, c.TakeSnapshot)
    assert len(failed) == 1 and ctl.evaluation.current.suspended
    # A PS that did take the failed snapshot frees it; the lost round's stays until the restart.
    assert of(decisions, c.DropSnapshot) == [c.DropSnapshot(failed[0].round_id, best_effort=True)]
    assert of(ctl.step(c.VersionReported(1)), c.TakeSnapshot) == []  # not asked again before a Tick
    ps.down = False
    decisions = ctl.step(c.Tick())
    assert of(decisions, c.DropSnapshot) == [c.DropSnapshot(1, best_effort=True)]
    again = ctl.evaluation.current.round_id
    assert again not in (1, failed[0].round_id) and not ctl.evaluation.current.suspended
    assert ctl.evaluation.current.reason == "final, again after a PS restart"
    decisions = run_round(ctl, dispatcher)
    assert of(decisions, c.FireEpochEnd) == [c.FireEpochEnd(0, {}, snapshot=again)]  # the epoch follows the round


def test_a_round_that_cannot_start_while_a_ps_restarts_starts_later():
    ctl, dispatcher, ps, _ = make(workers=1, epochs=1, tasks=1, with_eval=True)
    ctl.start()
    ps.down = True
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert not ctl.evaluation.busy and not dispatcher.finished
    ps.down = False
    ctl.step(c.Tick())
    assert ctl.evaluation.current.reason == "final"


def test_a_round_whose_snapshot_failed_again_as_it_started_is_asked_again():
    """Its snapshot asked at the epoch's end failed, then again when the round was to start (the
    PS still restarting): the round was left waiting for an answer that had come, and the job
    waited for its final evaluation forever."""
    ctl, dispatcher, ps, _ = make(workers=1, epochs=1, tasks=1, with_eval=True)
    ctl.start()
    ps.down = True
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))  # asked at the epoch's end: failed
    ctl.step(c.Tick())  # asked again to start the round: failed again
    assert not ctl.evaluation.busy
    ps.down = False
    ctl.step(c.Tick())
    assert ctl.evaluation.busy and ctl.evaluation.current.reason == "final"


def test_evaluation_start_delay_and_throttle_follow_the_injected_clock():
    clock = FakeClock()
    ps = FakePS()
    main = TaskManager(shards(2), num_epochs=1, clock=clock, shuffle=False)
    evaluation = EvaluationService(shards(1), metrics_fn=dict, evaluation_steps=10,
                                   start_delay_secs=30, throttle_secs=60, clock=clock)
    dispatcher = TaskDispatcher(main, evaluation)
    ctl = answering_snapshots(c.Controller("train", dispatcher, InstanceManager(1), evaluation_steps=10, clock=clock), ps)
    ctl.start()
    ctl.step(c.VersionReported(10))
    assert not evaluation.busy  # within the start delay
    clock.now += 30
    ctl.step(c.Tick())
    assert evaluation.busy
    run_round(ctl, dispatcher)
    ctl.step(c.VersionReported(25))
    assert not evaluation.busy  # throttled
    clock.now += 60
    ctl.step(c.Tick())
    assert evaluation.busy and evaluation.current.reason == "every 10 versions"


def test_rounds_every_n_versions_count_from_the_jobs_version_and_stop_with_training():
    """Found by the simulator (seed 6489): a PS restarted empty counts its versions from 0, a
    round's snapshot carries the lowest PS version, so every round was due again at once and
    periodic rounds ran back to back forever, after training too: the job never ended."""
    ctl, dispatcher, ps, _ = make(workers=1, epochs=1, tasks=2, evaluation_steps=5, with_eval=True)
    ctl.start()
    training = [take(dispatcher, 0), take(dispatcher, 1)]  # held while the rounds run
    ps.version = 0  # the snapshots: a PS far behind the others
    ctl.step(c.VersionReported(30))
    assert ctl.evaluation.busy and ctl.evaluation.current.reason == "every 5 versions"
    run_round(ctl, dispatcher, worker=2)
    ctl.step(c.Tick())
    assert not ctl.evaluation.busy  # not due again at once
    ctl.step(c.VersionReported(35))
    assert ctl.evaluation.busy  # 5 versions of the job later
    run_round(ctl, dispatcher, worker=2)
    for worker, task in enumerate(training):  # training ends: the final round, no periodic one after
        answer(ctl, report(ctl, dispatcher, task, worker))
    assert ctl.evaluation.current.reason == "final"
    run_round(ctl, dispatcher, worker=2)
    ctl.step(c.VersionReported(100))
    assert not ctl.evaluation.busy and dispatcher.finished


def test_the_evaluate_command_runs_one_round_and_finishes():
    ctl, dispatcher, ps, _ = make(command="evaluate", workers=1)
    ps.version = 300
    ctl.start()
    ctl.step(c.Tick())
    assert ctl.evaluation.current.reason == "evaluate" and ctl.evaluation.current.model_version == 300
    decisions = run_round(ctl, dispatcher)
    assert kinds(decisions).count("RecordEvaluation") == 1
    assert of(decisions, c.FireEpochEnd) == []  # no callbacks outside training
    assert dispatcher.finished
    assert ctl.step(exit_of(0)) == [c.Finish()]


def test_predict_finishes_when_every_task_is_done():
    ctl, dispatcher, _, _ = make(command="predict", workers=1, tasks=2)
    ctl.start()
    for _ in range(2):
        decisions = report(ctl, dispatcher, take(dispatcher, 0), 0)
        assert of(decisions, c.EndEpoch) == [] and of(decisions, c.SaveLedger) == []
    assert dispatcher.finished
    assert ctl.step(exit_of(0)) == [c.Finish()]


@pytest.mark.parametrize("code", [0, -15])
def test_workers_leaving_after_end_are_not_refilled(code):
    ctl, dispatcher, _, _ = make(workers=1, epochs=1, tasks=1)
    ctl.start()
    answer(ctl, report(ctl, dispatcher, take(dispatcher, 0), 0))
    assert ctl.step(exit_of(0, code=code)) == [c.Finish()]
    assert ctl.instances.preemptions == 0


# ---------------------------------------------------------------- what the workers' reports make fatal


def bad(index: int, reason: str = "InvalidArgumentError: Feature: label is required") -> BadRecord:
    return BadRecord("data.rec", index, reason)


def test_by_default_the_first_bad_record_fails_the_job_naming_its_file_index_and_reason():
    ctl, dispatcher, _, _ = make(workers=1)
    ctl.start()
    task = take(dispatcher, 0)
    outcome = dispatcher.report(task.task_id, 0, "BadRecordError: ...", 0, bad_records=[bad(3)])
    decisions = ctl.step(c.TaskReported(task.task_id, 0, outcome.accepted))
    assert kinds(decisions) == ["Fail"]
    fail = decisions[0]
    assert isinstance(fail.cause, BadRecordError) and fail.cause.records == [bad(3)]
    assert fail.error.startswith("bad record: data.rec: record 3: InvalidArgumentError: Feature: label is required.")
    assert ctl.step(c.Tick()) == []  # the outcome stands


def test_bad_records_within_max_bad_records_pass_and_one_more_fails_the_job():
    ctl, dispatcher, _, _ = make(workers=1, epochs=2, max_bad_records=1)
    ctl.start()
    first = take(dispatcher, 0)
    outcome = dispatcher.report(first.task_id, 0, "", 9, bad_records=[bad(3)])
    assert of(ctl.step(c.TaskReported(first.task_id, 0, outcome.accepted)), c.Fail) == []
    second = take(dispatcher, 0)  # the same record met again (another epoch, a retry) counts once
    outcome = dispatcher.report(second.task_id, 0, "", 9, bad_records=[bad(3)])
    assert of(answer(ctl, ctl.step(c.TaskReported(second.task_id, 0, outcome.accepted))), c.Fail) == []
    third = take(dispatcher, 0)
    outcome = dispatcher.report(third.task_id, 0, "", 9, bad_records=[bad(15, "CRC mismatch")])
    decisions = ctl.step(c.TaskReported(third.task_id, 0, outcome.accepted))
    assert kinds(decisions) == ["Fail"]
    assert decisions[0].error.startswith("2 bad records, more than --max_bad_records=1: data.rec: record 3:")
    assert "data.rec: record 15: CRC mismatch" in decisions[0].error


def test_predict_skips_no_bad_record_whatever_max_bad_records_says():
    ctl, dispatcher, _, _ = make(command="predict", workers=1, max_bad_records=5)
    ctl.start()
    task = take(dispatcher, 0)
    outcome = dispatcher.report(task.task_id, 0, "BadRecordError: ...", 0, bad_records=[bad(3)])
    decisions = ctl.step(c.TaskReported(task.task_id, 0, outcome.accepted))
    assert kinds(decisions) == ["Fail"]
    assert "`elasticdl predict` skips no record" in decisions[0].error and "--max_bad_records" not in decisions[0].error


def test_training_that_diverged_fails_the_job_with_the_workers_message():
    ctl, dispatcher, _, _ = make(workers=2)
    ctl.start()
    task = take(dispatcher, 1)
    message = "TrainingDivergedError: task 0 (data.rec records 0-9), batch 2: the loss is nan ..."
    outcome = dispatcher.report(task.task_id, 1, message, 0, diverged=True)
    decisions = ctl.step(c.TaskReported(task.task_id, 1, outcome.accepted))
    assert kinds(decisions) == ["Fail"]
    assert isinstance(decisions[0].cause, TrainingDivergedError)
    assert decisions[0].error == f"worker 1: {message}"


def test_a_dropped_task_fails_the_job_naming_the_task_its_records_and_its_last_error():
    ctl, dispatcher, _, _ = make(workers=1, max_task_retries=1)
    ctl.start()
    decisions = []
    for _ in range(2):
        task = take(dispatcher, 0)
        decisions = report(ctl, dispatcher, task, 0, err="ValueError: boom")
    assert kinds(decisions) == ["Fail"]
    assert decisions[0].cause is None  # JobFailedError: exit code 1
    assert decisions[0].error.startswith(
        f"training task {task.task_id} (data.rec records 0-9, epoch 1) failed 2 times and was dropped; "
        "the last error: worker 0 failed it: ValueError: boom."
    )
    assert "--max_task_retries" in decisions[0].error


def test_a_task_dropped_after_timeouts_fails_the_job_at_the_next_event():
    ctl, dispatcher, _, clock = make(workers=1, max_task_retries=0)
    ctl.start()
    take(dispatcher, 0)
    clock.now += 601  # past --task_timeout: the next get_task drops it
    dispatcher.get_task(0)
    decisions = ctl.step(c.Tick())
    assert kinds(decisions) == ["Fail"] and "held it longer than --task_timeout" in decisions[0].error


def test_a_dropped_evaluation_task_fails_the_job_too():
    ctl, dispatcher, _, _ = make(command="evaluate", workers=1, max_task_retries=0)
    ctl.start()
    ctl.step(c.Tick())  # starts the round
    task = take(dispatcher, 0)
    decisions = report(ctl, dispatcher, task, 0, err="InvalidArgumentError: bad metric input")
    assert kinds(decisions) == ["Fail"]
    assert decisions[0].error.startswith(f"evaluation task {task.task_id} (data.rec records 0-9")


def test_a_leveling_refused_for_longer_than_its_patience_lets_the_job_end_unleveled():
    """A PS relaunched empty that no worker can refill (no worker left has built the model) must
    not hold the job's end forever (the simulator, seed 269, before an all-empty job was let through)."""
    from elasticdl.master.leveling import LEVEL_PATIENCE_SECONDS

    ctl, dispatcher, _, clock = make(workers=1, sync=True, tasks=1, epochs=1)
    ctl.start()
    assert of(report(ctl, dispatcher, take(dispatcher, 0), 0), c.LevelVersions) == [c.LevelVersions()]
    assert of(ctl.step(c.VersionsNotLeveled()), c.EndEpoch) == []
    clock.now += LEVEL_PATIENCE_SECONDS / 2
    assert of(ctl.step(c.Tick()), c.LevelVersions) == [c.LevelVersions()]
    assert of(ctl.step(c.VersionsNotLeveled()), c.EndEpoch) == []  # still patient
    clock.now += LEVEL_PATIENCE_SECONDS / 2
    ctl.step(c.Tick())
    assert of(ctl.step(c.VersionsNotLeveled()), c.EndEpoch) == [c.EndEpoch(0, final=True, sync_model=True)]


def test_a_worker_frozen_while_it_held_no_task_is_replaced_once_it_went_silent_past_the_timeout():
    """Found by the nemesis (freeze_worker, seed 26): the only worker was SIGSTOPped between its
    last task and an evaluation round's first. It held no task, so no task timed out, and the job
    waited for ever. A worker heard from once that holds no task and asks for nothing within
    --task_timeout is replaced; one that keeps asking is not, nor one never heard from (starting)."""
    ctl, dispatcher, _, clock = make(workers=2, epochs=1, tasks=2, task_timeout=5.0)
    ctl.start()
    task = take(dispatcher, 0)
    dispatcher.heard(0, clock.now)
    dispatcher.heard(1, clock.now)
    for _ in range(3):  # worker 1 asks every second, holding nothing: alive
        clock.now += 1.0
        dispatcher.heard(1, clock.now)
    answer(ctl, report(ctl, dispatcher, task, 0))
    dispatcher.heard(0, clock.now)  # its report: then it freezes, holding no task
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == []
    clock.now += 5.5
    dispatcher.heard(1, clock.now)
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == [
        c.ReplaceWorker(0, "it holds no task and asked for none within --task_timeout")]
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == []  # asked once
    ctl.step(exit_of(0, code=-9))
    clock.now += 60.0  # a worker never heard from (the replacement, starting) is not counted
    dispatcher.heard(1, clock.now)
    assert of(ctl.step(c.Tick()), c.ReplaceWorker) == []
