"""The master's decisions as a pure step function: events in, decisions out.

``Controller.step(event)`` takes one typed event (a role exited, a task was reported,
the model version moved, a timer fired, a scale or stop request, the state store was
lost, or the outcome of a decision the job carried out) and returns the decisions it
leads to (start or stop a worker, relaunch a PS, end an epoch, fire callbacks, record
an evaluation, save the ledger, finish, fail). It does no I/O of its own: it calls the
pure cores (task ledger, instance manager, evaluation scheduler, worker clocks) and the
``Job`` carries out what it returns. Tests drive it event by event with a fake clock.

Example::

    controller = Controller("train", dispatcher, instances, clock=time.monotonic)
    decisions = controller.start()             # [Launch(0, HIGH), Launch(1, HIGH)]
    decisions = controller.step(TaskReported(task_id=3, worker_id=0, accepted=True))
    decisions = controller.step(EpochEnded(0))  # the job ended epoch 0 as asked
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elasticdl.data.errors import BadRecordError
from elasticdl.errors import TrainingDivergedError
from elasticdl.launch.exits import ProcessExit
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.evaluation_rounds import EvaluationRounds
from elasticdl.master.evaluation_service import EvaluationService, TaskDispatcher
from elasticdl.master.events import *  # noqa: F403  (the vocabulary: ``c.Tick``, ``c.EndEpoch``, ...)
from elasticdl.master.events import (
    BackupAdded,
    BackupNotAdded,
    BackupPromoted,
    Decision,
    EndEpoch,
    EpochEndDeferred,
    EpochEnded,
    EpochEndFired,
    Event,
    Fail,
    FenceHandouts,
    Finish,
    FireEpochBegin,
    FireEpochEnd,
    HandoutsFenced,
    LevelVersions,
    LiveWorkersNotTold,
    OpenEpoch,
    Phase,
    PromotionFailed,
    PSRelaunched,
    PSRollback,
    PSSilent,
    ReplaceWorker,
    RoleExited,
    SaveLedger,
    ScaleRequested,
    SnapshotFailed,
    SnapshotTaken,
    StopRequested,
    StoreLost,
    TellLiveWorkers,
    Tick,
    VersionChanged,
    VersionReported,
    VersionsLeveled,
    VersionsNotLeveled,
    describe_exit,
)
from elasticdl.master.failover import ReplicaRoles
from elasticdl.master.instance_manager import GiveUp, InstanceManager, Launch, Stop
from elasticdl.master.leveling import Leveling
from elasticdl.master.ps_losses import PS_SILENT_SECONDS, PSLosses  # noqa: F401  (c.PS_SILENT_SECONDS)

logger = logging.getLogger(__name__)

# A parameter server is relaunched (from the latest checkpoint) at most this many times.
MAX_PS_RELAUNCHES = 3
# Sync mode: the PS hear of fewer workers holding a task only once the count stayed lower this
# long. A worker between two tasks is not gone; told at once, the PS would apply a version with
# fewer gradients and refuse that worker's next one as stale.
LIVE_WORKERS_SETTLE_SECONDS = 1.0
# Once every task and evaluation is done, workers leave at their next request for a task; one
# still there this long later is frozen or hung, and is killed rather than holding the job open.
WORKERS_LEAVE_SECONDS = 10.0


class Controller(PSLosses):
    """The job's decisions for ``train``, ``evaluate`` and ``predict``.

    ``dispatcher`` holds the main task ledger (training or prediction; none for
    ``evaluate``) and the evaluation service. The controller tracks the workers it
    launched itself, so it needs no backend to know when all of them are gone.
    """

    def __init__(
        self,
        command: str,
        dispatcher: TaskDispatcher,
        instances: InstanceManager,
        clocks: WorkerClocks | None = None,
        *,
        clock: Callable[[], float],
        sync_mode: bool = False,
        evaluation_steps: int = 0,
        max_ps_relaunches: int = MAX_PS_RELAUNCHES,
        keeps_ledger: bool = True,
        max_bad_records: int = 0,
        wait_for_epoch_callbacks: bool = False,
        replica_roles: ReplicaRoles | None = None,
        saves_checkpoints: bool = False,
    ):
        self.command = command
        self.dispatcher = dispatcher
        self.tasks = dispatcher.main
        self.evaluation: EvaluationService | None = dispatcher.evaluation
        self.instances = instances
        self.clocks = clocks or WorkerClocks()
        self.sync_mode = sync_mode and command == "train"
        self.evaluation_steps = evaluation_steps
        self.max_ps_relaunches = max_ps_relaunches
        self.keeps_ledger = keeps_ledger and command == "train"
        self._clock = clock
        # Bad records the workers may skip in the whole job (none in predict: the outputs
        # would no longer line up with the inputs).
        self.max_bad_records = max_bad_records if command != "predict" else 0
        # An EarlyStopping callback is present: the next epoch starts only once the callbacks
        # saw this epoch's evaluation, so that a stop drops the next epoch's tasks.
        self.wait_for_epoch_callbacks = wait_for_epoch_callbacks and command == "train"

        self.workers: set[int] = set()  # launched and not exited yet
        self.failures: list[ProcessExit] = []  # workers that exited non-zero
        self.model_version = 0
        self.ps_relaunches = 0
        self.rollbacks: list[PSRollback] = []
        self.replicas = replica_roles  # --ps_replicas: a PS death promotes backups (master/failover.py)
        self.saves_checkpoints = saves_checkpoints  # --checkpoint_dir: a dead PS comes back from a cut
        self._reopening = False  # a PS lost after the last task reopened the job: not all done yet
        self._promoting_after_finish: dict[int, ProcessExit] = {}  # its promotion, then its relaunch
        self.stop_reason = ""
        self.epoch_done = -1  # the last training epoch whose end was handled
        self._opened = self.tasks.epoch if self.tasks is not None else 0  # the last epoch whose tasks were opened
        self._ending: EndEpoch | None = None  # issued, its outcome not back yet
        self._end_held = False  # an end found a PS away: not asked again before the next Tick
        self._deferred_epoch: int | None = None  # the last epoch whose end was deferred (logged once)
        self.rounds = (EvaluationRounds(self.evaluation, evaluation_steps, fires_epoch_ends=command == "train")
                       if self.evaluation is not None else None)
        self._live_workers_told = -1
        # A tell found a PS away: not told again before the next Tick. Told again at once, the
        # job's feed would alternate TellLiveWorkers and LiveWorkersNotTold forever and never
        # get back to polling the exits that bring the PS back (a livelock).
        self._tell_held = False
        self._fewer_live_since: float | None = None
        self.leveling = Leveling(self._clock)  # sync: every shard at one version once training is over
        self._saved_seq = -1
        self.outcome: Finish | Fail | None = None
        self._phase = Phase.RUNNING
        self.phases: list[Phase] = [Phase.RUNNING]  # the phases the job went through, each once, in order
        self.replaced: list[ReplaceWorker] = []  # workers killed for making no progress
        self._done_since: float | None = None  # when all_done first held with workers still there
        self._ps_silent_since: dict[int, float] = {}
        self._ps_replaced: set[int] = set()  # killed for silence, exit not seen yet
        if command == "evaluate":
            self.rounds.queue("evaluate", None)

    # ------------------------------------------------------------ entry points

    def start(self) -> list[Decision]:
        """The first decisions: the initial workers."""
        return self._carry(self.instances.initial())

    def step(self, event: Event) -> list[Decision]:
        if self.outcome is not None:
            return []
        self._reopening = False  # its recovery was carried out before this event
        decisions = self._on(event)
        if self.outcome is None:
            decisions += self._advance()
        for decision in decisions:
            if isinstance(decision, Finish | Fail):
                self.outcome = decision
                decisions = decisions[: decisions.index(decision) + 1]
                break
        phase = self.phase
        if phase != self._phase:
            # Every epoch goes running -> ending epoch -> running: those only at DEBUG.
            routine = {phase, self._phase} == {Phase.RUNNING, Phase.ENDING_EPOCH}
            logger.log(logging.DEBUG if routine else logging.INFO, "job phase: %s -> %s", self._phase, phase)
            if phase not in self.phases:
                self.phases.append(phase)
            self._phase = phase
        return decisions

    @property
    def phase(self) -> Phase:
        """Where the job is, derived from the state the controller keeps (one place, named)."""
        if self.outcome is not None:
            return Phase.FINISHED if isinstance(self.outcome, Finish) else Phase.FAILED
        if self._ending is not None or self._end_held:
            return Phase.ENDING_EPOCH
        if self.all_done:
            return Phase.LEAVING
        if self.dispatcher.main_finished and self.command != "evaluate":
            return Phase.FINAL_EVALUATION
        if self.instances.desired == 0 and not self.workers:
            return Phase.SCALED_TO_ZERO
        return Phase.RUNNING

    @property
    def all_done(self) -> bool:
        """Training (or prediction) finished, its last epoch's end handled, no evaluation left.

        The epoch check matters: the last task may be reported between two events, and the
        final evaluation is only queued when the epoch end is handled.
        """
        if not self.dispatcher.main_finished or self._ending is not None or self._reopening:
            return False
        if self.command == "train" and self.epoch_done < self.tasks.epoch:
            return False
        if self.command == "train" and self.sync_mode and not self.leveling.done:
            return False  # a PS relaunched after the final epoch end: at one version again first
        return self.rounds is None or self.rounds.idle

    # ------------------------------------------------------------ events

    def _on(self, event: Event) -> list[Decision]:
        match event:
            case RoleExited(exit=exit_) if exit_.role == "ps":
                return self._on_ps_exit(exit_)
            case RoleExited(exit=exit_):
                return self._on_worker_exit(exit_)
            case ScaleRequested(num_workers=n):
                logger.info("scaling to %d workers (from %d)", n, self.instances.desired)
                return self._carry(self.instances.scale(n))
            case VersionReported(version=version):
                return self._on_version(version)
            case StopRequested(reason=reason):
                self._stop_training(reason)
            case StoreLost(reason=reason):
                return [Fail(f"the job state in etcd cannot be trusted any more: {reason}")]
            case EpochEnded(epoch=epoch):
                return self._on_epoch_ended(epoch)
            case EpochEndFired(epoch=epoch):
                if self.wait_for_epoch_callbacks:
                    return self._next_epoch(epoch)
            case EpochEndDeferred(epoch=epoch):
                if self._deferred_epoch != epoch:
                    logger.info("end of epoch %d waits for a restarting PS", epoch + 1)
                self._ending, self._deferred_epoch, self._end_held = None, epoch, True
            case Tick():
                # Asked again once per poll, after the job looked at which roles exited: asked at
                # once, a PS whose exit was not seen yet kept the job from ever seeing it.
                self._end_held = self._tell_held = False
                self.leveling.tick()
                if self.rounds is not None:
                    self.rounds.tick()
                if self.replicas is not None:
                    return self.replicas.due()  # spares to catch up as backups
            case PSSilent(indices=indices):
                return self._on_ps_silent(indices)
            case SnapshotTaken() | SnapshotFailed() if self.rounds is not None:
                return self.rounds.on_snapshot(event)
            case HandoutsFenced(handouts=handouts, marks=marks):
                self.tasks.fenced(list(handouts), marks)
            case LiveWorkersNotTold():
                self._live_workers_told, self._tell_held = -1, True
            case VersionsLeveled(version=version):
                self.leveling.leveled()
                return self._on_version(version)
            case VersionsNotLeveled():
                self.leveling.refused()
            case BackupPromoted() | PromotionFailed() | BackupAdded() | BackupNotAdded() if self.replicas is not None:
                return self._on_replica_answer(event)  # master/ps_losses.py
            case PSRelaunched(index=index, restored_version=restored, retrained=retrained, missing=missing):
                self.rollbacks.append(PSRollback(index, self.model_version, restored, retrained, missing))
        return []

    def _on_worker_exit(self, exit_: ProcessExit) -> list[Decision]:
        self.workers.discard(exit_.index)
        if any(r.index == exit_.index for r in self.replaced):
            exit_ = ProcessExit(exit_.role, exit_.index, -9 if exit_.returncode else 0, exit_.log_tail)
        if exit_.returncode != 0:
            self.failures.append(exit_)
            logger.error(describe_exit(exit_, "exited"))
        self.dispatcher.recover_worker_tasks(exit_.index)
        self.clocks.forget(exit_.index)
        return self._carry(self.instances.on_exit(
            exit_.index, exit_.returncode, exit_.log_tail, job_done=self.dispatcher.finished
        ))

    def _on_version(self, version: int) -> list[Decision]:
        # Monotone: worker reports and PS polls arrive out of order; a PS restored from a
        # checkpoint moves on from its lower version without the callbacks seeing it go back.
        if version <= self.model_version:
            return []
        self.model_version = version
        return [VersionChanged(version)]

    def _on_epoch_ended(self, epoch: int) -> list[Decision]:
        ending, self._ending = self._ending, None
        if ending is None or ending.epoch != epoch:
            return []  # not the end this controller asked for
        self.epoch_done = epoch
        decisions: list[Decision] = []
        if self.rounds is not None:  # evaluated on the model as this epoch left it
            decisions += self.rounds.queue("final" if ending.final else f"epoch {epoch + 1}", epoch)
        else:
            decisions.append(FireEpochEnd(epoch))
        if not self.wait_for_epoch_callbacks:
            decisions += self._next_epoch(epoch)
        return decisions

    def _next_epoch(self, epoch: int) -> list[Decision]:
        """After epoch ``epoch``'s end (with ``wait_for_epoch_callbacks``, its callbacks): the
        next epoch's callbacks, then its tasks."""
        if self.stop_reason or epoch + 1 >= self.tasks.num_epochs or epoch + 1 <= self._opened:
            return []
        self._opened = epoch + 1
        return [FireEpochBegin(epoch + 1), OpenEpoch(epoch + 1)]

    def _stop_training(self, reason: str) -> None:
        if self.command == "train" and not self.stop_reason:
            self.stop_reason = reason
            dropped = self.tasks.stop()
            logger.info("%s: training stops in epoch %d of %d (%d of its tasks not started are dropped; "
                        "no later epoch starts)", reason, self.tasks.epoch + 1, self.tasks.num_epochs, dropped)

    # ------------------------------------------------------------ what is due

    def _advance(self) -> list[Decision]:
        failed = self._task_faults()
        if failed is not None:
            return [failed]
        decisions: list[Decision] = self._replace_stalled()
        if self.command == "train":
            decisions += self._ledger_and_live_workers()
            end = self._next_epoch_end()
            if end is not None:
                return decisions + [end]  # its outcome comes back as an event before anything else
            if self._ending is not None:
                return decisions
        if self.rounds is not None:
            decisions += self.rounds.advance(
                self.model_version, training_over=self.command == "train" and self.dispatcher.main_finished)
        if self.all_done:
            self.dispatcher.finish()  # workers get END and exit
        if self.workers and self.all_done:
            decisions += self._replace_lingering()
        if not self.workers:
            if self.all_done:
                decisions.append(Finish())
            elif self.instances.desired > 0:
                first = self.failures[0] if self.failures else None
                decisions.append(Fail(
                    "every worker exited before the job was done"
                    + (f"; the first failure: {describe_exit(first, 'died')}" if first else "")
                ))
            # scaled to zero: wait for `elasticdl scale`
        return decisions

    def _task_faults(self) -> Fail | None:
        """What the workers' reports make fatal: training diverged, more bad records than
        --max_bad_records, or a task dropped after --max_task_retries (the job would miss its
        records). Checked after every event: a task is dropped also when it times out."""
        dispatcher = self.dispatcher
        diverged = dispatcher.divergences()
        if diverged:
            cause = TrainingDivergedError(diverged[0])
            return Fail(str(cause), cause)
        if dispatcher.bad_record_count > self.max_bad_records:
            bad = dispatcher.bad_records()
            cause = BadRecordError(bad, self.max_bad_records, skippable=self.command != "predict")
            return Fail(str(cause), cause)
        dropped = dispatcher.dropped_tasks()
        if dropped:
            task = dropped[0]
            return Fail(
                f"{task.type} task {task.task_id} ({task.shard.path} records {task.shard.start}-"
                f"{task.shard.end - 1}, epoch {task.epoch + 1}) failed {task.retries} times and was dropped; "
                f"the last error: {task.last_error or 'unknown'}. Fix its cause (the worker logs have the "
                "traceback), or raise --max_task_retries if it is transient."
            )
        return None

    def _replace_stalled(self) -> list[Decision]:
        """Gray failures: a worker whose task timed out (it is frozen, or hung in a call) is
        killed; its task is back in todo already, and its slot is refilled like a preempted one's.
        So is a worker frozen while it held no task: it went silent past --task_timeout (the
        nemesis froze the only worker between its last task and an evaluation round's first, and
        the job waited for ever)."""
        return (self._replace(self.dispatcher.stalled_workers(), "its task timed out (--task_timeout)")
                + self._replace(self.dispatcher.silent_workers(self._clock()),
                                "it holds no task and asked for none within --task_timeout"))

    def _replace_lingering(self) -> list[Decision]:
        now = self._clock()
        if self._done_since is None:
            self._done_since = now
        if now - self._done_since < WORKERS_LEAVE_SECONDS:
            return []
        return self._replace(sorted(self.workers), f"it did not leave within {WORKERS_LEAVE_SECONDS:g} s of the job's end")

    def _replace(self, indices, reason: str) -> list[Decision]:
        decisions: list[Decision] = []
        for index in indices:
            if index in self.workers and not any(r.index == index for r in self.replaced):
                decision = ReplaceWorker(index, reason)
                logger.warning("worker %d makes no progress: %s; killing it", index, reason)
                self.replaced.append(decision)
                decisions.append(decision)
        return decisions

    def _ledger_and_live_workers(self) -> list[Decision]:
        decisions: list[Decision] = []
        handouts, task_ids = self.tasks.pending_fences()
        if handouts:
            decisions.append(FenceHandouts(tuple(handouts), tuple(task_ids)))
        if self.keeps_ledger and self.tasks.seq != self._saved_seq:
            self._saved_seq = self.tasks.seq
            decisions.append(SaveLedger())
        if self.sync_mode:
            count = len(self.tasks.active_workers())  # training: an evaluating worker pushes nothing
            if count >= self._live_workers_told:
                self._fewer_live_since = None  # a dip that ended does not count towards the next one
            # 0 is told once training is over, at once, before the final model is read: with
            # nobody left to push, a PS applies the gradients still pending in its average, whose
            # records the ledger already counts done (the job ended with them in no model).
            # Between epochs a pending gradient just waits for the next epoch's first pushes.
            if count == 0 and self.tasks.finished:
                settled = self._live_workers_told != 0  # also after a tell that found a PS away (-1)
            else:
                # Fewer at once when no task is left to hand out: the idle worker is not between two
                # tasks, and a version waiting for its gradient would hold the others for nothing.
                settled = count > 0 and (self._settled(count) or not self.tasks.counts()[0])
            if settled and count != self._live_workers_told and not self._tell_held:
                self._live_workers_told = count
                decisions.append(TellLiveWorkers(count))
            # Once 0 was told (no gradient waits in an average), before the final end reads the model.
            if self.leveling.due(self.tasks.finished, self._live_workers_told == 0):
                decisions.append(LevelVersions())
        return decisions

    def _settled(self, count: int) -> bool:
        """More workers (or a PS that knows nothing yet) at once; fewer once it lasted."""
        if count > self._live_workers_told:
            return True
        now = self._clock()
        if self._fewer_live_since is None:
            self._fewer_live_since = now
        if now - self._fewer_live_since < LIVE_WORKERS_SETTLE_SECONDS:
            return False
        self._fewer_live_since = None
        return True

    def _next_epoch_end(self) -> EndEpoch | None:
        if self._ending is not None or self._end_held:
            return None
        finished = self.tasks.finished
        last_complete = self.tasks.epoch if finished or self.tasks.between_epochs else self.tasks.epoch - 1
        if self.epoch_done >= last_complete:
            return None
        epoch = self.epoch_done + 1
        if self.sync_mode and finished and epoch == self.tasks.epoch and not self.leveling.done:
            return None  # the final end reads the model once every shard is at one version
        self._ending = EndEpoch(epoch, final=finished and epoch == self.tasks.epoch,
                                sync_model=self.evaluation is None)
        return self._ending

    # ------------------------------------------------------------ helpers

    def _carry(self, decisions) -> list[Decision]:
        """Instance-manager decisions: track launched workers, turn GiveUp into Fail."""
        out: list[Decision] = []
        for decision in decisions:
            if isinstance(decision, Launch):
                self.workers.add(decision.index)
                out.append(decision)
            elif isinstance(decision, Stop):
                out.append(decision)
            elif isinstance(decision, GiveUp):
                out.append(Fail(decision.error))
        return out
