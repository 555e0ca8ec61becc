"""The simulated master: the real Controller, task ledger and instance manager, run by an
executor that mirrors elasticdl/master/job.py.

``SimMaster.run`` is Job._loop (events that arrived, exits polled, the version polled, a Tick,
each through ``elasticdl.master.feed.feed``), and ``carry_out`` is Job._carry_out against the
simulated roles: start and stop workers, relaunch a PS from the latest cut (the survivors roll
back, every hand-out is fenced, the ledger rewinds), tell the PS the live workers, end epochs
(arming the epoch's cut), save the ledger to the state store. The workers' calls
(``rpc_*``) are the master servicer's: they go to the task dispatcher and enqueue events.
"""

from __future__ import annotations

import dataclasses
import logging

from elasticdl.data.sources import Shard
from elasticdl.master import controller as c
from elasticdl.master import recovery_policy as policy
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.cut_recovery import (
    cuts_found,
    discard_abandoned,
    latest_cut,
    rewind_ledger,
)
from elasticdl.master.evaluation_service import EvaluationService, TaskDispatcher
from elasticdl.master.feed import FeedLivelock, feed
from elasticdl.master.instance_manager import InstanceManager, Launch, Stop
from elasticdl.master.stream_source import POLL_SECS as STREAM_POLL_SECONDS
from elasticdl.master.stream_source import KafkaStreamSource
from elasticdl.master.stream_tasks import StreamTaskManager
from elasticdl.master.task_manager import Task, TaskManager
from elasticdl.master.tasks import NoTask
from elasticdl.model import checkpoint
from elasticdl.sim.leader import SimLeadership
from elasticdl.sim.master_replicas import SimReplicaRecovery
from elasticdl.sim.model import eval_metrics
from elasticdl.sim.scheduler import Future, Sleep
from elasticdl.sim.stream import IDLE_SECONDS
from elasticdl.sim.transport import Deferred, Unavailable
from elasticdl.store.errors import StateStoreError
from elasticdl.store.memory import MemoryStateStore

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # Job's poll_seconds
VERSION_POLL_SECONDS = 0.5
TASK_TIMEOUT = 20.0
RECORDS_PER_TASK = 4
FINGERPRINT = "sim"
STORE_RETRY_BUDGET = 5.0  # RetryPolicy's default budget
PARK_SECONDS = 1.0  # a get_task with no task now waits this long for one (RequestDesk parks it)


class SimMaster(SimReplicaRecovery):
    """One master process (a restart makes a new one, of a higher term)."""

    def __init__(self, world, term: int) -> None:
        self.world = world
        self.term = term
        self.alive = True
        self.exits_handled: set[int] = set()  # workers whose exit this master fed its controller
        self._parked: list[tuple[int, Future, float]] = []  # (worker, its answer, its deadline)
        self.frozen = False
        self.process = None  # its coroutine, set by the world
        mode = world.mode
        shards = [Shard(world.data.path, s, min(s + RECORDS_PER_TASK, world.records))
                  for s in range(0, world.records, RECORDS_PER_TASK)]
        if world.topic is not None:  # master/stream_source.py stream_ledger: tasks come as records arrive
            self.tasks = StreamTaskManager(task_timeout=TASK_TIMEOUT, max_task_retries=3, seed=world.seed,
                                           clock=world.clock, gate_epochs=True, fences_pushes=True)
        else:
            self.tasks = TaskManager(shards, num_epochs=world.epochs, task_timeout=TASK_TIMEOUT, max_task_retries=3,
                                     seed=world.seed, clock=world.clock, gate_epochs=True, fences_pushes=True)
        self.source: KafkaStreamSource | None = None  # the stream's, opened once the ledger is back
        self.instances = InstanceManager(mode.num_workers)
        self.evaluation = None
        if world.validation is not None:
            val = [Shard(world.validation.path, s, min(s + RECORDS_PER_TASK, world.val_records))
                   for s in range(0, world.val_records, RECORDS_PER_TASK)]
            self.evaluation = EvaluationService(val, eval_metrics, evaluation_steps=world.evaluation_steps,
                                                task_timeout=TASK_TIMEOUT, clock=world.clock)
        self.dispatcher = TaskDispatcher(self.tasks, self.evaluation)
        self.clocks = WorkerClocks()
        self.events: list = []
        self.controller: c.Controller | None = None
        self.store = (MemoryStateStore("sim", world.store_backend, retry=world.no_retry)
                      if world.mode.store == "etcd" else None)  # each master process has its own client
        self.leadership = SimLeadership(self.store, f"master-{term}", world.clock) if self.store else None
        self.revision = 0  # the ledger's revision in the store (compare-and-set)
        self.unsaved = False  # a ledger write waits for the store to come back
        self.saved_seq = -1  # the ledger seq last written (a retry after an outage may have written it)
        self.resumed = False
        self.routes = list(range(mode.num_ps))  # --ps_replicas: shard -> the PS of its primary

    # ------------------------------------------------------------ start (Job.run, _start)

    def open(self):
        """Resume the ledger from the store (etcd-like), then the PS from the latest cut."""
        world = self.world
        if self.leadership is not None:
            self.term = yield from self.leadership.acquire()
        world.took_over(self)
        if self.store is not None:
            waited = 0.0
            while True:  # the store's retry budget (RetryPolicy.budget): a short outage is ridden out
                try:
                    snapshot, self.revision = self.store.load_ledger()
                    break
                except StateStoreError:
                    if waited >= STORE_RETRY_BUDGET:
                        raise
                    yield Sleep(0.1)
                    waited += 0.1
            if snapshot is not None:
                self.tasks.restore(snapshot)
                self.resumed = True
        self.tasks.start_term(self.term)
        if world.topic is not None:  # open_stream: from the ledger's offsets (earliest for a new job)
            # Job: its stream's tasks are handed out once the store holds them (the etcd-like one here).
            stored = (lambda: self.saved_seq) if self.store is not None else None
            self.tasks.hold_until_stored = stored is not None
            self.source = KafkaStreamSource(world.topic, world.topic.partition_ids(), RECORDS_PER_TASK, IDLE_SECONDS,
                                            clock=world.clock, stored_seq=stored)
            self.source.open(self.tasks.offsets(), watch=False)
        world.network.endpoints["master"] = self  # it serves once it leads and its ledger is back
        # Job._restore_latest_checkpoint and _rewind_to_restored_cut, on the shared cut_recovery.
        cut = latest_cut(world.checkpoint_dir) if self.resumed else None
        for ps_id in range(world.mode.num_ps):
            world.start_ps(ps_id, restore_from=cut.path if cut else "", fence=0, delay=0.0)
        self._configure_replicas()
        if self.resumed:  # Job._rewind_to_restored_cut: the recovery policy's plan_resume
            found = None if cut is None else policy.CutFound(cut.path, cut.version, True, cut.marks,
                                                             tuple(cut.records_applied))
            plan = policy.plan_resume(policy.ResumeFacts(world.mode.num_ps, bool(world.checkpoint_dir), found))
            if isinstance(plan, policy.KeepLedger):
                world.oracle_emptied_all()
            else:
                if isinstance(plan, policy.StartOver):
                    discard_abandoned(world.checkpoint_dir, plan.version, plan.restart, self.term)
                rewound = rewind_ledger(self.tasks, plan.marks, plan.held, "the resumed model", "master restart")
                if isinstance(plan, policy.StartOver) and not rewound.possibly_missing:
                    for ps_id in plan.restart:  # every record is trained again: held to once
                        world.oracle.shards[ps_id].maybe_missing = False
        self.controller = c.Controller("train", self.dispatcher, self.instances, self.clocks,
                                       sync_mode=not world.mode.use_async, keeps_ledger=True, clock=world.clock,
                                       evaluation_steps=world.evaluation_steps, replica_roles=self._replica_roles(),
                                       saves_checkpoints=bool(world.checkpoint_dir))
        for decision in self.controller.start():
            self.carry_out(decision)

    # ------------------------------------------------------------ the loop (Job._loop)

    def run(self):
        yield from self.open()
        last_version_poll = last_stream_poll = -1.0
        while self.controller.outcome is None:
            yield Sleep(POLL_SECONDS)
            if self.leadership is not None and not self.leadership.keep_alive():
                # Job: the keep-alive's on_lost halts the dispatcher and fails the job (exit 1).
                self.dispatcher.halt("lost the leader lock")
                self.world.master_stopped(self)
                return
            if not self.world.is_leader(self):
                return
            events, self.events = self.events, []
            versions = [e.version for e in events if isinstance(e, c.VersionReported)]
            events = [e for e in events if not isinstance(e, c.VersionReported)]
            events += [c.VersionReported(max(versions))] if versions else []
            events += [c.RoleExited(e) for e in self.world.poll_exits()]
            now = self.world.clock()
            if now - last_version_poll >= VERSION_POLL_SECONDS:
                events.append(c.VersionReported(self._poll_version()))
                last_version_poll = now
            if self.unsaved:
                self._save_ledger()
            if self.source is not None:  # the source's thread, then Job._run_loop's feed
                if now - last_stream_poll >= STREAM_POLL_SECONDS:
                    self.source.poll_once()
                    last_stream_poll = now
                self.source.feed(self.tasks)
            events.append(c.Tick())
            for event in events:
                if isinstance(event, c.RoleExited) and event.exit.role == "worker":
                    self.exits_handled.add(event.exit.index)
                try:
                    feed(self.controller, event, self.carry_out)
                except FeedLivelock as err:
                    self.world.livelock(str(err))
                    return
                self.settle()
        self.world.job_ended(self, self.controller.outcome)

    # ------------------------------------------------------------ decisions (Job._carry_out)

    def carry_out(self, decision) -> list:
        world = self.world
        world.acted(self)
        match decision:
            case Launch(index=index):
                world.start_worker(index)
            case Stop(index=index):
                world.request_stop(index)
            case c.FenceHandouts(handouts=handouts, task_ids=task_ids):
                return [c.HandoutsFenced(handouts, self._fence(list(handouts), list(task_ids)))]
            case c.ReplaceWorker(index=index):
                world.kill_worker(index)  # request_stop with no grace: a frozen process takes no SIGTERM
            case c.RelaunchPS(exit=exit_, moved_to=moved_to) if moved_to:
                world.start_ps(exit_.index, restore_from="", fence=0, moved_to=moved_to)  # a spare
            case c.RelaunchPS(exit=exit_):
                return [self._relaunch_ps(exit_)]
            case c.PromoteBackup():
                return self._promote_backups(decision)
            case c.AddBackup():
                return self._add_backup(decision)
            case c.TellLiveWorkers(count=count):
                try:
                    self._each(lambda ps: ps.set_live_workers(count))
                except Unavailable:
                    return [c.LiveWorkersNotTold()]
            case c.LevelVersions():
                return [self._level_versions()]
            case c.EndEpoch():
                return self._end_epoch(decision)
            case c.FireEpochEnd(epoch=epoch):
                return [c.EpochEndFired(epoch)]
            case c.TakeSnapshot(round_id=round_id):
                try:
                    return [c.SnapshotTaken(round_id, min(self._each(lambda ps: ps.take_snapshot(round_id))))]
                except Unavailable as err:
                    return [c.SnapshotFailed(round_id, str(err))]  # a PS is restarting
            case c.DropSnapshot(round_id=round_id):
                try:
                    self._each(lambda ps: ps.drop_snapshot(round_id))
                except Unavailable:
                    pass  # a PS that is down held no snapshot any more
            case c.OpenEpoch(epoch=epoch):
                self.tasks.open_epoch(epoch)
            case c.SaveLedger():
                return self._save_ledger()
        return []

    def _save_ledger(self) -> list:
        """The write-behind store in short: an outage is ridden out (written again at the next
        poll); a lost compare-and-set means another master: this one must stop."""
        store = self.store
        if store is None or self.tasks.seq == self.saved_seq:
            return []
        try:
            snapshot = self.tasks.snapshot(FINGERPRINT)
            self.revision = store.save_ledger(snapshot, self.revision, retry=self.world.no_retry)
            self.saved_seq = snapshot.seq
            self.unsaved = False
        except StateStoreError as err:
            if self.world.store_cut:
                self.unsaved = True
                return []
            return [c.StoreLost(str(err))]
        return []

    def _relaunch_ps(self, exit_) -> c.PSRelaunched:
        """Job._relaunch_ps: the facts gathered, the recovery policy's plan carried out."""
        world, mode = self.world, self.world.mode
        facts = policy.PSLossFacts(
            dead=exit_.index, num_ps=mode.num_ps, checkpoint_dir=bool(world.checkpoint_dir), trains=True,
            cuts=cuts_found(world.checkpoint_dir),  # the newest verified cut (a damaged one is passed over)
            missing_without_cut=self._missing_without_cut())
        plan = policy.plan_ps_loss(facts)
        if isinstance(plan, policy.RefillEmpty):
            world.start_ps(exit_.index, restore_from="", fence=0)
            return c.PSRelaunched(exit_.index, None, missing=plan.missing)
        fence = self.tasks.fence_all()
        if isinstance(plan, policy.StartOver):  # every PS empty at version 0; the old timeline's files go
            for ps_id in plan.restart:
                if ps_id != exit_.index:
                    world.ps[ps_id].alive = False  # a planned stop, not a death: no exit
                    world.network.killed(f"ps-{ps_id}")
            discard_abandoned(world.checkpoint_dir, 0, plan.restart, self.term)
            for ps_id in plan.restart:
                world.start_ps(ps_id, restore_from="", fence=fence)
            rewound = rewind_ledger(self.tasks, plan.marks, plan.held, "the model started over", "start over")
            if not rewound.possibly_missing:  # every record is trained again: the oracle holds them to once
                for ps_id in plan.restart:
                    world.oracle.shards[ps_id].maybe_missing = False
            return c.PSRelaunched(exit_.index, 0, retrained=rewound.retrained, missing=rewound.possibly_missing)
        cut = plan.cut
        world.start_ps(exit_.index, restore_from=cut.path, fence=fence)
        for ps_id in plan.survivors:
            try:
                self.shard_servers()[ps_id].roll_back(cut.path, self.term, fence)
            except (Unavailable, checkpoint.CheckpointError, ValueError, OSError):
                # Job._restore_cut: dead too, or a spare not serving yet: it starts again from the cut.
                world.ps[ps_id].alive = False  # a planned stop, not a death: no exit
                world.network.killed(f"ps-{ps_id}")
                world.start_ps(ps_id, restore_from=cut.path, fence=fence)
        rewound = rewind_ledger(self.tasks, plan.marks, plan.held, cut.path, "rollback")
        return c.PSRelaunched(exit_.index, cut.version, retrained=rewound.retrained, missing=rewound.possibly_missing)

    def _missing_without_cut(self) -> int:
        mode = self.world.mode
        return policy.records_between_pulls(mode.get_model_steps, mode.push_steps, mode.overlap, 2,
                                            len(self.controller.workers))

    def _level_versions(self):
        """PSClient.level_versions: every PS up to the highest shard's version."""
        try:
            version = max(self._each(lambda ps: ps.version()))
            return c.VersionsLeveled(max(self._each(lambda ps: ps.level_version(version, self.term))))
        except (Unavailable, ValueError):
            return c.VersionsNotLeveled()

    def _fence(self, handouts: list[int], task_ids: list[int]) -> dict[int, int] | None:
        try:
            per_ps = self._each(lambda ps: ps.fence(handouts, task_ids, self.term))
        except Unavailable:
            return None
        return {t: min(marks.get(t, 0) for marks in per_ps) for t in task_ids}

    def _each(self, call) -> list:
        """One call per PS, as PSClient._each makes them (in parallel: every PS that answers
        carries it out); the first error is raised once all were made."""
        results, error = [], None
        for ps in self.shard_servers(lenient=True):
            try:
                results.append(call(ps))
            except Unavailable as err:
                error = error or err
        if error is not None:
            self._refresh_routes()
            raise error
        return results

    def shard_servers(self, lenient: bool = False) -> list:
        """Each shard's calls on the PS of its primary (the master's routes, as its PSClient's
        after ``reroute``). ``lenient``: a shard held nowhere gives a stand-in that raises
        Unavailable at its call (the others are still called), else Unavailable at once."""
        servers = []
        for shard, index in enumerate(self.routes):
            try:
                servers.append(self.world.ps[index].for_shard(shard))  # the PS's ShardRouter decides
            except Unavailable:
                if not lenient:
                    self._refresh_routes()
                    raise
                servers.append(_Away(f"ps-{index}"))
        return servers

    def _end_epoch(self, decision: c.EndEpoch) -> list:
        try:
            versions = [ps.stats()[0] for ps in self.shard_servers()]
        except Unavailable:
            return [c.EpochEndDeferred(decision.epoch)]
        if self.world.checkpoint_dir and not decision.final:
            at = max(versions) + 1
            for ps in self.shard_servers(lenient=True):
                try:
                    ps.checkpoint_at(at, self.term)
                except (Unavailable, checkpoint.CheckpointError):
                    pass  # past it already (async) or away: the next cut serves
        return [c.VersionReported(max(versions)), c.EpochEnded(decision.epoch)]

    def _poll_version(self) -> int:
        try:
            return min(ps.version() for ps in self.shard_servers())
        except Unavailable:
            return 0

    # ------------------------------------------------------------ the servicer (worker calls)

    def rpc_get_task(self, worker_id: int):
        self.dispatcher.heard(worker_id, self.world.clock())  # RequestDesk.serve
        task = self._hand_out(worker_id)
        # RequestDesk: parked until a task comes. In a stream job, where workers wait for records
        # (the file families answer WAIT and the worker asks again: the timelines their seeds replay).
        if task is NoTask.WAIT and self.source is not None and not self.dispatcher.halted:
            future = Future()
            self._parked.append((worker_id, future, self.world.clock() + PARK_SECONDS))
            return Deferred(future)
        return task

    def settle(self) -> None:
        """RequestDesk.settle: after a change, each parked request gets a task if one came, END or
        WAIT once the job finished or halted, WAIT at its deadline."""
        still = []
        for worker_id, future, deadline in self._parked:
            if self.dispatcher.finished or self.dispatcher.halted:
                future.resolve(NoTask.END if not self.dispatcher.halted else NoTask.WAIT)
                continue
            task = self._hand_out(worker_id)
            if task is not NoTask.WAIT or self.world.clock() >= deadline:
                future.resolve(task)
            else:
                still.append((worker_id, future, deadline))
        self._parked = still

    def _hand_out(self, worker_id: int):
        task = self.dispatcher.get_task(worker_id)
        if not isinstance(task, Task):
            return task
        if worker_id in self.exits_handled:
            # A request the worker made before it died (parked, or delivered late), answered after
            # its exit was handled: the task would sit in doing for a process that is gone.
            self.world.violation(f"task {task.task_id} handed to worker {worker_id}, whose exit the master "
                                 "had handled")
        return dataclasses.replace(task)

    def rpc_report(self, task_id: int, worker_id: int, err: str, records: int, interrupted: bool, handout: int,
                   states=None):
        self.dispatcher.heard(worker_id, self.world.clock())
        outcome = self.dispatcher.report(task_id, worker_id, err, records, states, interrupted=interrupted,
                                         handout=handout)
        self.events.append(c.TaskReported(task_id, worker_id, outcome.accepted))
        self.settle()
        return outcome.accepted

    def rpc_progress(self, task_id: int, worker_id: int, done: int) -> bool:
        self.dispatcher.heard(worker_id, self.world.clock())
        return self.dispatcher.progress(task_id, worker_id, done).accepted

    def rpc_report_clock(self, worker_id: int, clock: int, blocked: float):
        view = self.clocks.report(worker_id, clock, self.tasks.active_workers(), blocked)
        return view.clock, view.slowest


class _Away:
    """A shard whose PS holds no replica of it now: every call fails as for a PS that is down."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, method: str):
        def away(*args, **kwargs):
            raise Unavailable(f"{self.name} is not serving")
        return away
