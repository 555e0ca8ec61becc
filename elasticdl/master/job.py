"""The master's job: set up the roles, feed the controller events, carry out its decisions.

The decisions live in ``elasticdl.master.controller`` (a pure step function). ``Job``
does the I/O around it: it starts the master's gRPC server and the parameter servers,
builds the master's copy of the model (callbacks, export), turns backend exits, task
reports, version reports, scale requests, store failures and timer ticks into events,
and carries out what the controller decides on the backend, the PS and the callbacks.
One loop serves the three commands: ``train``, ``evaluate`` and ``predict``.

The executor is one class in four modules, one part each: this one (the loop, the
decisions), ``job_setup`` (the start), ``recovery`` (PS relaunches, rollbacks, a resumed
master) and ``job_end`` (the final steps and the report).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import time

import grpc

from elasticdl.config import JobConfig
from elasticdl.data.sources import make_shards
from elasticdl.errors import JobFailedError
from elasticdl.launch.api import Backend
from elasticdl.launch.local import LocalBackend
from elasticdl.logs import master_log_handler
from elasticdl.master import controller as c
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.evaluation_service import EvaluationService, TaskDispatcher
from elasticdl.master.feed import feed
from elasticdl.master.instance_manager import InstanceManager, Launch, Stop
from elasticdl.master.job_end import JobEnd
from elasticdl.master.job_setup import JobSetup, write_job_config
from elasticdl.master.job_state import JobState, job_fingerprint
from elasticdl.master.preflight import CheckedJob
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.progressive import progressive_windows, to_tensorboard
from elasticdl.master.recovery import Recovery
from elasticdl.master.replica_recovery import ReplicaRecovery
from elasticdl.master.report import CheckpointFailures, JobReport
from elasticdl.master.request_desk import RequestDesk
from elasticdl.master.requests import RequestLine
from elasticdl.master.stream_export import capture_ledger, continuous_export, snapshot_model
from elasticdl.master.stream_source import open_stream, stream_ledger
from elasticdl.master.task_manager import TaskManager, TaskType
from elasticdl.master.telemetry import StalenessSummary
from elasticdl.store import StateStoreError

__all__ = ["Job", "JobFailedError", "JobReport"]

logger = logging.getLogger(__name__)

# A worker asked to leave (scale-down) gets this long to finish its batch and report.
WORKER_STOP_GRACE_SECS = 30.0
# What a PS call answers while a PS is away: down or restarting (UNAVAILABLE), or frozen or hung
# (DEADLINE_EXCEEDED: the master's calls to the PS have a deadline). The call is tried again at
# a later Tick; the exit, or the probe's silence, brings the PS back.
PS_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def default_backend(config: JobConfig) -> Backend:
    """The local backend, logging to the job's log directory (echoed with --log_level debug)."""
    return LocalBackend(config.job.effective_log_dir, echo=config.job.log_level.upper() == "DEBUG")


def prewarm(backend: Backend, config: JobConfig) -> None:
    """Let the backend get the job's roles ready while the master still checks the job (the
    local backend's warm spares import TensorFlow and rehearse a step meanwhile:
    docs/elasticity.md)."""
    known = ["--job_config", write_job_config(config)]
    backend.prewarm("ps", config.elasticity.num_ps)
    backend.prewarm("worker", config.elasticity.num_workers, known)


class Job(JobSetup, Recovery, ReplicaRecovery, JobEnd):
    """One ElasticDL job on a backend; ``run()`` returns its JobReport."""

    def __init__(
        self,
        checked: CheckedJob,
        command: str = "train",
        backend: Backend | None = None,
        poll_seconds: float = 0.2,
    ):
        self.checked = checked
        self.config = cfg = checked.config
        self.command = command
        self.backend = backend or default_backend(cfg)
        self.poll_seconds = poll_seconds
        self.has_header = cfg.data.has_header

        self.main_tasks: TaskManager | None = stream_ledger(cfg, command)  # a Kafka stream's, or None
        self.stream = None  # its source (opened once the ledger is resumed)
        self.exports = None  # --export_every_secs: its continuous export (master/stream_export.py)
        if command in ("train", "predict") and self.main_tasks is None:
            self.main_tasks = TaskManager(
                make_shards(checked.files, cfg.effective_records_per_task),
                num_epochs=cfg.training.num_epochs if command == "train" else 1,
                task_timeout=cfg.elasticity.task_timeout,
                max_task_retries=cfg.elasticity.max_task_retries,
                seed=cfg.data.shuffle_seed,
                task_type=TaskType.TRAINING if command == "train" else TaskType.PREDICTION,
                shuffle=command == "train" and cfg.data.shuffle_tasks,
                gate_epochs=command == "train",  # the controller opens each epoch (OpenEpoch)
                fences_pushes=command == "train",  # a task taken back waits for FenceHandouts
                clock=time.monotonic,  # --task_timeout: a frozen worker's task comes back
            )
        records = sum(n for _, n in checked.files)
        self.progress = TrainingProgress(records, cfg.training.num_epochs if command == "train" else 1)
        self.clocks = WorkerClocks()
        elasticity = cfg.elasticity
        self.instances = InstanceManager(
            elasticity.num_workers, elasticity.worker_pod_priority, elasticity.relaunch_on_worker_failure
        )
        self.dispatcher = TaskDispatcher(self.main_tasks, None)
        self.evaluation: EvaluationService | None = None
        self.controller: c.Controller | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # from gRPC and store threads
        # The workers' requests: gRPC threads ask through the line, the loop serves them at the desk.
        self.requests = RequestLine(self._events.put)
        self.progressive = progressive_windows(cfg.stream.window_records, checked.spec, command,
                                               sink=lambda window: to_tensorboard(self.tensorboard, window))
        self.desk = RequestDesk(self.dispatcher, self.progress, progressive=self.progressive)
        self._follow_ups: collections.deque = collections.deque()  # from callbacks, in the loop's thread
        self.state = JobState(cfg, command, job_fingerprint(cfg, checked.files), on_lost=self._store_lost)
        self.ps_addresses: list[str] = []
        self.master_address = ""
        self._worker_args: list[str] = []
        self._ps_args: dict[int, list[str]] = {}
        self._server = None
        self._token = ""  # the job's token (see _start)
        self._ps = None  # the master's own PSClient
        self._probe = None  # its look at the PS, in flight (master/ps_probe.py)
        self._trainer = None
        self._model = None  # the master's copy of the model (callbacks, export)
        self._preprocessing_state: bytes | None = None  # its adapted state, served to workers once built
        self._model_params_version = 0  # the model version of the parameters in self._model
        self.callbacks = None
        self.tensorboard = None
        self._epoch_loss_mark = (0.0, 0)
        self._telemetry_mark = StalenessSummary()
        self._checkpoint_failures = CheckpointFailures()
        self._step = "start"  # what the job is doing, for the report of a failure
        self.records_possibly_missing = 0  # resumed without a checkpoint: the ledger's done records
        self._resume_cut = ""  # resumed: the cut the PS restore (with its data position)
        # Roles the recovery started again while exits polled with theirs waited to be fed: those
        # exits are of the processes replaced, not of the new ones (see _run_loop).
        self._restarted: set[tuple[str, int]] = set()

    # ------------------------------------------------------------ JobControl (callbacks)

    @property
    def model_version(self) -> int:
        return self.controller.model_version if self.controller is not None else 0

    @property
    def params_version(self) -> int:
        """The model version of the parameters the callbacks see (an epoch's evaluated snapshot)."""
        return self._model_params_version

    def stop_training(self, reason: str) -> None:
        self._follow_ups.append(c.StopRequested(reason))

    def set_learning_rate(self, learning_rate: float) -> None:
        self._ps.set_learning_rate(learning_rate)

    def export(self, path: str) -> str:
        """Export the parameters the callbacks see now (those evaluated, at an epoch end)."""
        from elasticdl.model.export import export_saved_model

        return export_saved_model(self._serving_model(), path)

    def request_scale(self, num_workers: int) -> str:
        """`elasticdl scale`: change the desired number of workers (any thread)."""
        if self.command != "train":
            raise ValueError("only training jobs can be scaled")
        if num_workers < 0:
            raise ValueError(f"--num_workers must be 0 or more. Received: {num_workers}")
        problem = self.config.elasticity.workers_problem(num_workers)
        if problem:
            raise ValueError(problem)
        self._events.put(c.ScaleRequested(num_workers))
        return f"scaling job {self.config.job.job_name} to {num_workers} workers"

    def request_stop(self, reason: str) -> str:
        """`elasticdl stop` (any thread): the tasks in progress finish, then the job ends as a
        finished one (final checkpoint, export, report); a stream takes no new record."""
        if self.command != "train":
            raise ValueError(f"`elasticdl stop` ends training jobs; this is `elasticdl {self.command}`")
        self._events.put(c.StopRequested(reason))
        return (f"stopping job {self.config.job.job_name}: the tasks in progress finish, then the final "
                "checkpoint, export and report")

    def _store_lost(self, why: str) -> None:
        """From a store thread: stop handing out tasks now, then let the loop fail the job."""
        self.dispatcher.halt(why)
        self._events.put(c.StoreLost(why))

    # ------------------------------------------------------------ run

    def run(self) -> JobReport:
        """Run the job; its report. Whatever happens, runs/<job_name>/report.json is written: a
        job that failed (also at its very end) raises its error after writing what failed."""
        cfg = self.config
        started = time.monotonic()
        os.makedirs(cfg.job.effective_log_dir, exist_ok=True)
        master_log = master_log_handler(os.path.join(cfg.job.effective_log_dir, "master.log"))
        logging.getLogger().addHandler(master_log)
        report = JobReport(
            cfg.job.job_name,
            command=self.command,
            log_dir=cfg.job.effective_log_dir,
            consistency=cfg.consistency.description if self.command == "train" else "",
            tensorboard_log_dir=cfg.outputs.tensorboard_log_dir,
        )
        succeeded = False
        self._step = "start"
        try:
            resumed = self.state.open(self.main_tasks)
            if self.main_tasks is not None:
                self.main_tasks.start_term(self.state.term)
            self.stream = open_stream(cfg, self.main_tasks, self.state.term_floor,
                                      stored_seq=lambda: self.state.persisted_seq,
                                      forget_marks=lambda floor: self._ps.fence([], [], done_below=floor))
            self.exports = continuous_export(cfg, self.stream.topic) if self.stream is not None else None
            if resumed and cfg.checkpoints.checkpoint_dir:
                self._restore_latest_checkpoint()
            self._note_restore(report)
            self._start()
            if resumed and self.command == "train":
                self._rewind_to_restored_cut()
            self._step = "training" if self.command == "train" else self.command
            self._loop()
            if self.exports is not None:
                self.exports.wait()  # the final pull and export use the master's model after it
            self._despite_ps_losses(lambda: self._take_the_model(report))
            if self.progressive is not None:
                report.progressive = self.progressive.finish()
            self._finish(report)
            if self.exports is not None:
                report.exports = self.exports.summary()
            if self.stream is not None:
                self._step = "stream"
                self.stream.raise_if_deleted()  # after the final checkpoint and export: nothing trained is lost
            succeeded = True
        except BaseException as err:
            report.failed(self._step, err)
            raise
        finally:
            try:
                self._stop_everything(succeeded, interrupted=report.status == "interrupted")
            except BaseException as err:
                if report.status == "succeeded":
                    report.failed("stopping the roles", err)
                raise
            finally:
                self._complete_report(report, started)
                if self.stream is not None:
                    self.stream.close()
                logging.getLogger().removeHandler(master_log)
                master_log.close()
        return report

    # ------------------------------------------------------------ set-up

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        """The job's one thread for decisions: the only one that touches the ledgers and the
        controller. Requests (workers' calls) and events are taken in arrival order."""
        try:
            self._run_loop()
        finally:  # requests queued, held or still to come are answered at once, from no ledger
            self.desk.close(self.requests, self._events)

    def _run_loop(self) -> None:
        last_render = 0.0
        render_every = 0.5 if self.progress.is_tty else 5.0
        while self.controller.outcome is None:
            self._restarted.clear()
            events = self._next_events()
            events += [c.RoleExited(exit_) for exit_ in self.backend.poll_exits()]
            events += self._probe.poll()
            if self.stream is not None:  # new records become tasks here, in the ledger's thread
                self.stream.feed(self.main_tasks)
                self.progress.records_per_epoch = self.main_tasks.records_per_epoch
                self.progress.lag = self.stream.total_lag
                if self.exports is not None and self.main_tasks.stream_open:  # --export_every_secs: when due
                    self.exports.tick(lambda: capture_ledger(self.main_tasks),
                                      lambda: snapshot_model(self._ps, self._trainer))
            now = time.monotonic()
            events.append(c.Tick())
            for event in events:
                if isinstance(event, c.RoleExited) and (event.exit.role, event.exit.index) in self._restarted:
                    continue  # polled before the recovery started that role again: not the new process's
                self._feed(event)
                self.desk.settle()  # a change of a ledger hands a parked request its task
            if self.dispatcher.main_finished:
                self._render(final=True)  # training is done: the last line, once, not redrawn after
            elif now - last_render >= render_every:
                self._render()
                last_render = now
        if isinstance(self.controller.outcome, c.Fail):
            raise self.controller.outcome.cause or JobFailedError(self.controller.outcome.error)
        self._render(final=True)

    def _next_events(self) -> list:
        """The events that arrived, waiting up to the poll interval (or a parked request's deadline)
        for the first; the requests among them served now, in order, giving their events; one
        version (the newest)."""
        try:
            arrived = [self._events.get(timeout=self.desk.wait_seconds(self.poll_seconds))]
        except queue.Empty:
            return []
        while True:
            try:
                arrived.append(self._events.get_nowait())
            except queue.Empty:
                break
        events = self.desk.take(arrived)
        versions = [e.version for e in events if isinstance(e, c.VersionReported)]
        events = [e for e in events if not isinstance(e, c.VersionReported)]
        return events + ([c.VersionReported(max(versions))] if versions else [])

    def _feed(self, event) -> None:
        """One event through the controller, then the events its decisions lead to, in order."""
        feed(self.controller, event, self._answers)

    def _answers(self, decision) -> list:
        """What carrying out ``decision`` answers, then what the callbacks asked meanwhile."""
        answers = self._carry_out(decision) + list(self._follow_ups)
        self._follow_ups.clear()
        return answers

    # ------------------------------------------------------------ decisions

    def _carry_out(self, decision) -> list:
        """Do what the controller decided; returns the events that answer it."""
        match decision:
            case Launch(index=index, priority=priority):
                self.backend.start("worker", index, [*self._worker_args, "--worker_id", str(index)],
                                   priority=str(priority))  # Kubernetes: the pod's PriorityClass
                logger.info("worker %d started (%s priority)", index, priority)
            case Stop(index=index):
                logger.info("asking worker %d to leave (scale-down)", index)
                self.backend.request_stop("worker", index, WORKER_STOP_GRACE_SECS)
            case c.FenceHandouts(handouts=handouts, task_ids=task_ids):
                return [c.HandoutsFenced(handouts, self._fence(list(handouts), list(task_ids)))]
            case c.ReplacePS(index=index):
                self.backend.request_stop("ps", index, grace=0.0)  # its exit relaunches it
            case c.ReplaceWorker(index=index):
                self.backend.request_stop("worker", index, grace=0.0)  # a frozen process takes no SIGTERM
            case c.RelaunchPS(exit=exit_, moved_to=moved_to):
                return self._relaunch_spare(exit_, moved_to) if moved_to else [self._relaunch_ps(exit_)]
            case c.PromoteBackup():
                return self._promote_backups(decision)
            case c.AddBackup():
                return self._add_backup(decision)
            case c.TellLiveWorkers(count=count):
                try:
                    self._ps.set_live_workers(count)
                except grpc.RpcError:
                    return [c.LiveWorkersNotTold()]  # a PS is restarting: tell it later
            case c.LevelVersions():
                try:
                    return [c.VersionsLeveled(self._ps.level_versions())]
                except grpc.RpcError:
                    return [c.VersionsNotLeveled()]  # a PS is away: asked again at the next Tick
            case c.EndEpoch():
                return self._end_epoch(decision)
            case c.FireEpochBegin(epoch=epoch):
                self.callbacks.on_epoch_begin(epoch)
                return self._stop_flag()
            case c.FireEpochEnd(epoch=epoch, metrics=metrics, snapshot=snapshot):
                if snapshot:
                    try:
                        pulled_all = self._ps.pull_snapshot(snapshot)
                    except grpc.RpcError as err:
                        # A PS died after the evaluation and took the snapshot with it (it is being
                        # relaunched): the callbacks see the model as the master last pulled it.
                        logger.warning("epoch %d's snapshot is gone with a parameter server (%s): its "
                                       "callbacks see model version %d", epoch + 1, err.code().name,
                                       self._model_params_version)
                        pulled_all = []
                    if pulled_all:
                        version = 0
                        for pulled in pulled_all:
                            self._trainer.set_params(pulled.params)
                            version = max(version, pulled.version)
                        self._model_params_version = version  # ModelCheckpoint names this version
                self.callbacks.on_epoch_end(epoch, {**self._epoch_logs(), **metrics})
                # What the callbacks asked (a stop) before the answer: the next epoch opens after it.
                answers = self._stop_flag() + list(self._follow_ups)
                self._follow_ups.clear()
                return answers + [c.EpochEndFired(epoch)]
            case c.OpenEpoch(epoch=epoch):
                self.main_tasks.open_epoch(epoch)
            case c.VersionChanged(version=version):
                return self._on_version(version)
            case c.RecordEvaluation(result=result):
                if self.tensorboard is not None:
                    self.tensorboard.scalars(result.model_version, result.metrics, prefix="eval/")
            case c.TakeSnapshot(round_id=round_id):
                try:
                    return [c.SnapshotTaken(round_id, self._ps.take_snapshot(round_id))]
                except grpc.RpcError as err:
                    if err.code() not in PS_AWAY:
                        raise
                    return [c.SnapshotFailed(round_id, str(err.details()))]  # a PS is restarting
            case c.DropSnapshot(round_id=round_id, best_effort=best_effort):
                try:
                    self._ps.drop_snapshot(round_id)
                except grpc.RpcError as err:
                    # A PS that is down held no snapshot any more: its snapshots went with it.
                    if not best_effort and err.code() not in PS_AWAY:
                        raise
                    logger.info("snapshot %d not dropped on every PS (%s): a PS is away, and its "
                                "snapshots went with it", round_id, err.code().name)
            case c.SaveLedger():
                try:
                    self.state.save(self.main_tasks)
                except StateStoreError as err:
                    return [c.StoreLost(str(err))]
        return []

    def _stop_flag(self) -> list:
        """A Keras callback (e.g. keras.callbacks.EarlyStopping) set model.stop_training."""
        if getattr(self._model, "stop_training", False):
            self._model.stop_training = False
            return [c.StopRequested("a callback set model.stop_training")]
        return []

    def _end_epoch(self, decision: c.EndEpoch) -> list:
        """Telemetry (and the model, for callbacks without evaluation): every PS call first, so
        that a PS restart leaves nothing half done."""
        try:
            stats = self._ps_stats()
            version = self._sync_model() if decision.sync_model else 0
        except grpc.RpcError as err:
            if err.code() not in PS_AWAY:
                raise
            return [c.EpochEndDeferred(decision.epoch)]
        self._epoch_telemetry(stats, decision.epoch)
        if self.config.checkpoints.checkpoint_dir and not decision.final:
            self._arm_epoch_cut(stats)
        # The version first: callbacks at the epoch end (ModelCheckpoint) name the version they see.
        return [c.VersionReported(version), c.EpochEnded(decision.epoch)]

    def _on_version(self, version: int) -> list:
        if self.callbacks is not None:
            self.callbacks.on_model_version(version)
        if self.tensorboard is not None:
            self.tensorboard.scalars(version, {
                "train/loss": self.progress.recent_loss,
                "train/examples_per_second": self.progress.examples_per_second,
                "train/live_workers": len(self.controller.workers),
                **(self.stream.lag_scalars() if self.stream is not None else {}),
            })
        return self._stop_flag() if self.callbacks is not None else []

    # ------------------------------------------------------------ PS calls

    def _ps_stats(self) -> list:
        """Every PS's stats; checkpoint writes that failed since the last look are logged."""
        stats = self._ps.stats()
        self._note_stats(stats)
        return stats

    def _note_stats(self, stats: list) -> None:
        for message in self._checkpoint_failures.note(stats):
            logger.error("a checkpoint could not be written (%s); training goes on, the PS tries again "
                         "at its next checkpoint", message)

    def _serving_model(self):
        """The master's model with its embedding tables pulled in from the PS (serving needs no PS)."""
        return self._trainer.serving_model(self._ps.pull_embedding_table)

    def _sync_model(self) -> int:
        """Pull the PS parameters into the master's model (for callbacks and export); their version."""
        version = 0
        for pulled in self._ps.pull([-1] * self._ps.num_ps):
            self._trainer.set_params(pulled.params)
            version = max(version, pulled.version)
        self._model_params_version = version
        return version

    # ------------------------------------------------------------ reporting

    def _render(self, final: bool = False) -> None:
        if self.main_tasks is None:
            return
        epoch = self.main_tasks.epoch
        self.progress.render(epoch, self.main_tasks.epochs[epoch].records_done, final)
