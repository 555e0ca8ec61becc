"""The master's job: set up the roles, feed the controller events, carry out its decisions.

The decisions live in ``elasticdl.master.controller`` (a pure step function). ``Job``
does the I/O around it: it starts the master's gRPC server and the parameter servers,
builds the master's copy of the model (callbacks, export), turns backend exits, task
reports, version reports, scale requests, store failures and timer ticks into events,
and carries out what the controller decides on the backend, the PS and the callbacks.
One loop serves the three commands: ``train``, ``evaluate`` and ``predict``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import time

import grpc

from elasticdl import fs
from elasticdl.config import JobConfig
from elasticdl.data.sources import count_records, make_shards, resolve_data_files
from elasticdl.errors import JobFailedError
from elasticdl.launch.api import Backend, RoleExitedError
from elasticdl.launch.local import LocalBackend
from elasticdl.logs import master_log_handler
from elasticdl.master import controller as c
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.evaluation_service import EvaluationService, TaskDispatcher
from elasticdl.master.feed import feed
from elasticdl.master.instance_manager import InstanceManager, Launch, Stop
from elasticdl.master.job_state import JobState, job_fingerprint
from elasticdl.master.preflight import CheckedJob, check_eval_metrics
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.report import CheckpointFailures, JobReport
from elasticdl.master.servicer import MasterServicer
from elasticdl.master.task_manager import TaskManager, TaskType
from elasticdl.master.telemetry import StalenessSummary, summarize
from elasticdl.proto import elasticdl_pb2_grpc
from elasticdl.rpc import auth
from elasticdl.rpc.channel import make_server
from elasticdl.store import StateStoreError

__all__ = ["Job", "JobFailedError", "JobReport"]

logger = logging.getLogger(__name__)

PS_START_TIMEOUT = 120.0
# A worker asked to leave (scale-down) gets this long to finish its batch and report.
WORKER_STOP_GRACE_SECS = 30.0
# Workers report new versions as they make them; the PS is also asked this often, for the
# versions no worker reports (e.g. while every worker evaluates).
VERSION_POLL_SECONDS = 0.5


def default_backend(config: JobConfig) -> Backend:
    """The local backend, logging to the job's log directory (echoed with --log_level debug)."""
    return LocalBackend(config.job.effective_log_dir, echo=config.job.log_level.upper() == "DEBUG")


def write_job_config(config: JobConfig) -> str:
    """runs/<job>/job_config.json, every role's ``--job_config``; its path."""
    os.makedirs(config.job.run_dir, exist_ok=True)
    path = os.path.join(config.job.run_dir, "job_config.json")
    with open(path, "w") as f:
        f.write(config.to_json())
    return path


def prewarm(backend: Backend, config: JobConfig) -> None:
    """Let the backend get the job's roles ready while the master still checks the job (the
    local backend's warm spares import TensorFlow and rehearse a step meanwhile:
    docs/elasticity.md)."""
    known = ["--job_config", write_job_config(config)]
    backend.prewarm("ps", config.elasticity.num_ps)
    backend.prewarm("worker", config.elasticity.num_workers, known)


class Job:
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

        self.main_tasks: TaskManager | None = None
        if command in ("train", "predict"):
            self.main_tasks = TaskManager(
                make_shards(checked.files, cfg.effective_records_per_task),
                num_epochs=cfg.training.num_epochs if command == "train" else 1,
                task_timeout=cfg.elasticity.task_timeout,
                max_task_retries=cfg.elasticity.max_task_retries,
                seed=cfg.data.shuffle_seed,
                task_type=TaskType.TRAINING if command == "train" else TaskType.PREDICTION,
                shuffle=command == "train",
                gate_epochs=command == "train",  # the controller opens each epoch (OpenEpoch)
                fences_pushes=command == "train",  # a task taken back waits for FenceHandouts
            )
        records = sum(n for _, n in checked.files)
        self.progress = TrainingProgress(records, cfg.training.num_epochs if command == "train" else 1)
        self.clocks = WorkerClocks()
        elasticity = cfg.elasticity
        self.instances = InstanceManager(
            elasticity.num_workers, elasticity.worker_pod_priority, elasticity.relaunch_on_worker_failure
        )
        self.dispatcher = TaskDispatcher(self.main_tasks, None)
        self.main_tasks = self.dispatcher.main  # shared with the gRPC threads, under its lock
        self.evaluation: EvaluationService | None = None
        self.controller: c.Controller | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # from gRPC and store threads
        self._follow_ups: collections.deque = collections.deque()  # from callbacks, in the loop's thread
        self.state = JobState(cfg, command, job_fingerprint(cfg, checked.files), on_lost=self._store_lost)
        self.ps_addresses: list[str] = []
        self.master_address = ""
        self._worker_args: list[str] = []
        self._ps_args: dict[int, list[str]] = {}
        self._server = None
        self._token = ""  # the job's token (see _start)
        self._ps = None  # the master's own PSClient
        self._trainer = None
        self._model = None  # the master's copy of the model (callbacks, export)
        self._model_params_version = 0  # the model version of the parameters in self._model
        self.callbacks = None
        self.tensorboard = None
        self._epoch_loss_mark = (0.0, 0)
        self._telemetry_mark = StalenessSummary()
        self._checkpoint_failures = CheckpointFailures()
        self._step = "start"  # what the job is doing, for the report of a failure
        self.records_possibly_missing = 0  # resumed without a checkpoint: the ledger's done records
        self._resume_cut = ""  # resumed: the cut the PS restore (with its data position)

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
            if resumed and cfg.checkpoints.checkpoint_dir:
                self._restore_latest_checkpoint()
            self._note_restore(report)
            self._start()
            if resumed and self.command == "train":
                self._rewind_to_restored_cut()
            self._step = "training" if self.command == "train" else self.command
            self._loop()
            if self.command == "train":
                stats = self._ps_stats()
                report.staleness = self._epoch_telemetry(stats)
                report.exactly_once = self._check_exactly_once(stats)
            self._finish(report)
            succeeded = True
        except BaseException as err:
            report.failed(self._step, err)
            raise
        finally:
            try:
                self._stop_everything(succeeded)
            except BaseException as err:
                if report.status == "succeeded":
                    report.failed("stopping the roles", err)
                raise
            finally:
                self._complete_report(report, started)
                logging.getLogger().removeHandler(master_log)
                master_log.close()
        return report

    def _stop_everything(self, succeeded: bool) -> None:
        self.progress.close()  # the live line stops where it is, also on a failure
        self.backend.stop_all()
        if self._ps is not None:
            self._ps.close()
        if self._server is not None:
            self._server.stop(grace=1)
            self._remove_master_addr()
        if self.tensorboard is not None:
            self.tensorboard.close()
        job_done = succeeded and self.dispatcher.finished and self.dispatcher.main_finished
        self.state.close(self.main_tasks, job_done)

    def _remove_master_addr(self) -> None:
        """The master no longer serves: `elasticdl scale` then says the job ended, at once."""
        path = os.path.join(self.config.job.run_dir, "master.addr")
        try:
            with open(path) as f:
                mine = f.read().strip() == self.master_address
            if mine:  # a later run of the same job name may have written its own
                os.remove(path)
        except OSError:
            pass

    def _complete_report(self, report: JobReport, started: float) -> None:
        """Fill in the report and write report.json. On a failed job nothing here may hide its
        error: a problem is logged instead."""
        cfg = self.config
        try:
            report.seconds = round(time.monotonic() - started, 2)
            report.model_version = max(report.model_version, self.model_version)
            report.add_tasks(self.main_tasks, self.progress)
            if self.controller is not None:
                report.stopped_early = self.controller.stop_reason
                report.add_instances(self.instances, self.controller.ps_relaunches, self.controller.replaced)
                report.ps_rollbacks = [r.to_dict() for r in self.controller.rollbacks]
                report.records_possibly_missing = self.records_possibly_missing + sum(
                    r.records_possibly_missing for r in self.controller.rollbacks)
            report.state_store = "etcd" if cfg.elasticity.etcd_endpoints else "memory"
            report.resumed = self.state.resumed
            if self.state.in_etcd:
                report.add_outages(self.state.outages)
            report.add_evaluations(self.evaluation)
            report.add_faults(self.dispatcher, cfg.data.max_bad_records)
            report.checkpoint_failures = self._checkpoint_failures.total
            report.checkpoint_errors = list(self._checkpoint_failures.errors)
        except Exception:
            if report.status == "succeeded":
                raise
            logger.exception("the report of the failed job is incomplete")
        path = os.path.abspath(os.path.join(cfg.job.run_dir, "report.json"))
        try:
            report.report_file = path
            report.write(path)
        except OSError as err:
            report.report_file = ""
            logger.error("could not write the job's report to %s: %s", path, err)
            return
        if report.status != "succeeded":
            logger.error("the job %s at %s: %s; report: %s", report.status, report.failed_step, report.error, path)

    def _restore_latest_checkpoint(self) -> None:
        """A resumed job: the PS come back from the latest cut; the ledger goes back to its data
        position once they serve (``_rewind_to_restored_cut``)."""
        from elasticdl.model import checkpoint

        directory = self.config.checkpoints.checkpoint_dir
        if checkpoint.complete_versions(directory):
            self._resume_cut = checkpoint.resolve_checkpoint(directory)
            logger.info("the parameter servers restore the latest checkpoint, %s", self._resume_cut)

    def _rewind_to_restored_cut(self) -> None:
        """A resumed ledger says which records were done; the model holds those of the cut the PS
        restored. The records after the cut's data position are trained again (none without one)."""
        from elasticdl.model import checkpoint

        cut = self._resume_cut
        if cut:
            version, marks, _ = checkpoint.cut_position(cut)
            again = self.main_tasks.rewind(marks, cause="master restart")
            logger.warning("resumed at the checkpoint of version %d: %d records after its data position are "
                           "trained again", version, again)
        else:
            self.records_possibly_missing = sum(e.records_done for e in self.main_tasks.epochs)
            logger.warning("resumed without a checkpoint in --checkpoint_dir: the parameter servers start from "
                           "the initial model, so the %d records the ledger counts as done are not in it. "
                           "Give the job --checkpoint_dir to resume without losing them.",
                           self.records_possibly_missing)

    def _note_restore(self, report: JobReport) -> None:
        """Name the checkpoint the PS start from (they resolve the same directory the same way)."""
        from elasticdl.model import checkpoint

        init = self._resume_cut or self.config.checkpoints.checkpoint_dir_for_init
        if not init:
            return
        try:
            report.restored_from = checkpoint.resolve_checkpoint(init)
        except checkpoint.CheckpointError as err:  # the PS say so too, and the job fails on their exit
            logger.warning("%s", err)
            report.restored_from = init
            return
        if self.command != "train":
            report.checkpoint = report.restored_from  # the model evaluate and predict ran
        version = checkpoint.version_of(report.restored_from)
        self.progress.model_version = version
        logger.info("the parameter servers start from checkpoint %s (model version %d)", report.restored_from, version)

    # ------------------------------------------------------------ set-up

    def _start(self) -> None:
        cfg = self.config
        config_file = write_job_config(cfg)
        optimizer_file = os.path.join(cfg.job.run_dir, "optimizer.json")
        with open(optimizer_file, "w") as f:
            json.dump(self.checked.optimizer_spec.to_json_dict(), f)

        # Every role requires the job's token (elasticdl/rpc/auth.py): the backend's, which
        # it also hands to each role it starts; `elasticdl scale` reads it beside master.addr.
        self._token = self.backend.token()
        self._server = make_server(token=self._token)
        servicer = MasterServicer(self.dispatcher, self.progress, self.clocks,
                                  scale=self.request_scale, notify=self._events.put)
        elasticdl_pb2_grpc.add_MasterServicer_to_server(servicer, self._server)
        self.master_address = self.backend.bind_master(self._server)
        self._server.start()
        auth.write_private(os.path.join(cfg.job.run_dir, auth.TOKEN_FILE_NAME), self._token + "\n")
        with open(os.path.join(cfg.job.run_dir, "master.addr"), "w") as f:
            f.write(self.master_address)  # `elasticdl scale --job_name` finds the master here
        self.state.publish_master(self.master_address)
        logger.info("master serving on %s; logs in %s", self.master_address, cfg.job.effective_log_dir)

        for ps_id in range(cfg.elasticity.num_ps):
            self._ps_args[ps_id] = ["--job_config", config_file, "--optimizer_spec", optimizer_file,
                                    "--ps_id", str(ps_id), "--term", str(self.state.term)]
            resume = ["--restore_from", self._resume_cut] if self._resume_cut else []
            self.backend.start("ps", ps_id, self._ps_args[ps_id] + resume)
        from elasticdl.model.trainer import Trainer
        from elasticdl.rpc.ps_client import PSClient

        # The master's own model (callbacks, export) is built while the PS start: the
        # workers, started once the PS serve, wait for nothing else (docs/benchmarks.md).
        self._trainer = Trainer(
            self.checked.spec, cfg.training.model_params, cfg.training.embedding_swap_threshold_mb
        )
        self._trainer.ensure_built(self.checked.sample_features)
        self._model = self._trainer.model
        self.ps_addresses = self._wait_for_ps()
        logger.info(
            "parameter servers at %s%s", ", ".join(self.ps_addresses),
            f" ({cfg.consistency.description})" if self.command == "train" else "",
        )
        self._ps = PSClient(self.ps_addresses, token=self._token)
        self._ps.term = self.state.term
        self._model.stop_training = False  # Keras callbacks set it to end training
        self._start_evaluation_service()
        if cfg.outputs.tensorboard_log_dir:
            from elasticdl.master.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(cfg.outputs.tensorboard_log_dir)
            logger.info("TensorBoard: tensorboard --logdir %s", cfg.outputs.tensorboard_log_dir)
        user_callbacks = []
        if self.command == "train" and self.checked.spec.callbacks:
            user_callbacks = self.checked.spec.callbacks()
        self.controller = c.Controller(
            self.command, self.dispatcher, self.instances, self.clocks, clock=time.monotonic,
            sync_mode=not cfg.consistency.use_async, evaluation_steps=cfg.evaluation.evaluation_steps,
            keeps_ledger=self.state.keeps_ledger, max_bad_records=cfg.data.max_bad_records,
            wait_for_epoch_callbacks=_stops_early(user_callbacks),
        )
        if self.controller.wait_for_epoch_callbacks and self.evaluation is not None:
            logger.info("an EarlyStopping callback is present: each epoch starts once the callbacks saw "
                        "the evaluation of the one before (the workers evaluate meanwhile, not train)")
        if self.command == "train":
            from elasticdl.callbacks import CallbackList

            self.callbacks = CallbackList(user_callbacks, model=self._model, job=self)
            self.callbacks.on_train_begin()
            self.callbacks.on_epoch_begin(0)
        if self.command == "predict":
            from elasticdl.model.prediction import PARTS

            # Parts left by an earlier run must never be joined into this one's output.
            fs.rmtree(fs.join(cfg.outputs.prediction_outputs, PARTS))
        self._worker_args = ["--job_config", config_file, "--command", self.command,
                             "--master_addr", self.master_address, "--ps_addrs", ",".join(self.ps_addresses)]
        for decision in self.controller.start():
            self._carry_out(decision)
        logger.info("started %d workers", cfg.elasticity.num_workers)

    def _start_evaluation_service(self) -> None:
        cfg = self.config
        if self.command not in ("train", "evaluate") or not cfg.data.validation_data:
            return
        if not check_eval_metrics(self.checked.spec):
            return
        files = [(p, count_records(p, self.has_header)) for p in resolve_data_files(cfg.data.validation_data)]
        self.evaluation = EvaluationService(
            make_shards(files, cfg.effective_records_per_task),
            metrics_fn=self.checked.spec.eval_metrics_fn,
            snapshot=self._take_snapshot,
            evaluation_steps=cfg.evaluation.evaluation_steps,
            start_delay_secs=cfg.evaluation.evaluation_start_delay_secs,
            throttle_secs=cfg.evaluation.evaluation_throttle_secs,
            max_task_retries=cfg.elasticity.max_task_retries,
            task_timeout=cfg.elasticity.task_timeout,
        )
        self.dispatcher.evaluation = self.evaluation

    def _wait_for_ps(self) -> list[str]:
        """The backend knows where its PS serve (local: ready files; Kubernetes: their services)."""
        try:
            return self.backend.ps_addresses(self.config.elasticity.num_ps, PS_START_TIMEOUT)
        except RoleExitedError as err:
            raise JobFailedError(c.describe_exit(err.exit, "failed to start")) from None
        except TimeoutError as err:
            raise JobFailedError(str(err)) from None

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        last_render = last_version_poll = 0.0
        render_every = 0.5 if self.progress.is_tty else 5.0
        while self.controller.outcome is None:
            events = self._next_events()
            events += [c.RoleExited(exit_) for exit_ in self.backend.poll_exits()]
            now = time.monotonic()
            if now - last_version_poll >= VERSION_POLL_SECONDS:
                events.append(c.VersionReported(self._poll_version()))
                last_version_poll = now
            events.append(c.Tick())
            for event in events:
                self._feed(event)
            if self.dispatcher.main_finished:
                self._render(final=True)  # training is done: the last line, once, not redrawn after
            elif now - last_render >= render_every:
                self._render()
                last_render = now
        if isinstance(self.controller.outcome, c.Fail):
            raise self.controller.outcome.cause or JobFailedError(self.controller.outcome.error)
        self._render(final=True)

    def _next_events(self) -> list:
        """The events that arrived, waiting up to the poll interval for the first; one version (the newest)."""
        try:
            events = [self._events.get(timeout=self.poll_seconds)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
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
            case c.ReplaceWorker(index=index):
                self.backend.request_stop("worker", index, grace=0.0)  # a frozen process takes no SIGTERM
            case c.RelaunchPS(exit=exit_):
                return [self._relaunch_ps(exit_)]
            case c.TellLiveWorkers(count=count):
                try:
                    self._ps.set_live_workers(count)
                except grpc.RpcError:
                    return [c.LiveWorkersNotTold()]  # a PS is restarting: tell it later
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
            case c.DropSnapshot(round_id=round_id, best_effort=best_effort):
                try:
                    self._ps.drop_snapshot(round_id)
                except grpc.RpcError as err:
                    # A PS that is down held no snapshot any more: its snapshots went with it.
                    if not best_effort and err.code() != grpc.StatusCode.UNAVAILABLE:
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

    def _relaunch_ps(self, exit_) -> c.PSRelaunched:
        """A dead PS comes back on the same address. With a checkpoint, the whole job goes back to
        the latest complete cut: the dead PS restores it, the survivors roll back to it, every
        hand-out made so far is fenced, and the ledger returns to the cut's data position, so
        every record's update is in the model exactly once. Without one, it starts empty."""
        from elasticdl.model import checkpoint

        cfg = self.config
        args = list(self._ps_args[exit_.index])
        port = self.ps_addresses[exit_.index].rsplit(":", 1)[1]
        args += ["--port", port]
        cut = ""
        if cfg.checkpoints.checkpoint_dir and checkpoint.complete_versions(cfg.checkpoints.checkpoint_dir):
            cut = checkpoint.resolve_checkpoint(cfg.checkpoints.checkpoint_dir)
        if not cut or self.main_tasks is None:
            # Async workers pull every --get_model_steps batches, rounded up to a whole push
            # with --push_steps (they pull only right after a push); with overlap, one batch's
            # push is in flight besides.
            push = cfg.consistency.push_steps
            between_pulls = -(-cfg.consistency.get_model_steps // push) * push + int(cfg.consistency.overlap_communication)
            missing = between_pulls * cfg.training.minibatch_size * max(1, len(self.controller.workers))
            logger.error(
                "%s; relaunching it on port %s empty: the workers give it their copy of its variables. "
                "Without a checkpoint (--checkpoint_dir, --checkpoint_steps) the updates of up to %d records "
                "since the workers' last pull are missing from its shard, and its optimizer slots start over",
                c.describe_exit(exit_, "died"), port, missing,
            )
            self.backend.start("ps", exit_.index, args)
            return c.PSRelaunched(exit_.index, None, missing=missing)
        version, marks, _ = checkpoint.cut_position(cut)
        fence = self.main_tasks.fence_all()
        logger.error("%s; relaunching it on port %s from the checkpoint %s; every PS goes back to version %d",
                     c.describe_exit(exit_, "died"), port, cut, version)
        self.backend.start("ps", exit_.index, args + ["--restore_from", cut, "--fence", str(fence)])
        survivors = [i for i in range(self._ps.num_ps) if i != exit_.index]
        try:
            self._ps.restore(cut, fence, only=survivors)
        except grpc.RpcError as err:  # another PS is down too: its own relaunch restores the same cut
            logger.error("a surviving PS could not go back to %s: %s", cut, err.details())
        again = self.main_tasks.rewind(marks, cause="rollback")
        return c.PSRelaunched(exit_.index, version, retrained=again)

    def _fence(self, handouts: list[int], task_ids: list[int]) -> dict[int, int] | None:
        """Fence task hand-outs on every PS; each task's lowest applied mark (None: a PS is away)."""
        try:
            per_ps = self._ps.fence(handouts, task_ids)
        except grpc.RpcError as err:
            logger.warning("could not ask the parameter servers how far tasks %s were applied (%s): their "
                           "records are trained again", task_ids, err.details())
            return None
        return {t: min(marks.get(t, 0) for marks in per_ps) for t in task_ids}

    def _end_epoch(self, decision: c.EndEpoch) -> list:
        """Telemetry (and the model, for callbacks without evaluation): every PS call first, so
        that a PS restart leaves nothing half done."""
        try:
            stats = self._ps_stats()
            version = self._sync_model() if decision.sync_model else 0
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return [c.EpochEndDeferred(decision.epoch)]
        self._epoch_telemetry(stats, decision.epoch)
        if self.config.checkpoints.checkpoint_dir and not decision.final:
            self._arm_epoch_cut(stats)
        # The version first: callbacks at the epoch end (ModelCheckpoint) name the version they see.
        return [c.VersionReported(version), c.EpochEnded(decision.epoch)]

    def _check_exactly_once(self, stats: list) -> dict:
        """The model-side truth: each PS counted the records whose gradients it applied; they must
        be the records the ledger counts as done (bad records skipped in a batch were pushed with it)."""
        training_files = {path for path, _ in self.checked.files}
        skipped = sum(1 for r in self.dispatcher.bad_records() if r.path in training_files)
        done = sum(e.records_done for e in self.main_tasks.epochs) + skipped
        applied = [s.records_applied for s in stats]
        holds = all(a == done for a in applied)
        if holds:
            logger.info("exactly once: every PS applied the gradients of the %d records trained", done)
        else:
            logger.warning("the parameter servers applied the gradients of %s records, the ledger counts %d done "
                           "(batches skipped for NaN/Inf or staleness, or updates lost without a checkpoint)",
                           applied, done)
        return {"records_applied": applied, "records_done": done, "holds": holds}

    def _arm_epoch_cut(self, stats: list) -> None:
        """Every PS saves at the same next version: a cut near the epoch boundary, so a rollback
        never has to go back further than about an epoch."""
        at = max(s.version for s in stats) + 1
        try:
            self._ps.save_checkpoint(at_version=at)
        except grpc.RpcError as err:  # a PS is past it already (async) or away: the next cut serves
            logger.info("no checkpoint at the epoch's end (version %d): %s", at, err.details())

    def _on_version(self, version: int) -> list:
        if self.callbacks is not None:
            self.callbacks.on_model_version(version)
        if self.tensorboard is not None:
            self.tensorboard.scalars(version, {
                "train/loss": self.progress.recent_loss,
                "train/examples_per_second": self.progress.examples_per_second,
                "train/live_workers": len(self.controller.workers),
            })
        return self._stop_flag() if self.callbacks is not None else []

    # ------------------------------------------------------------ PS calls

    def _take_snapshot(self, round_id: int) -> int:
        try:
            return self._ps.take_snapshot(round_id)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                raise c.PSUnavailable(str(err.details())) from None
            raise

    def _ps_stats(self) -> list:
        """Every PS's stats; checkpoint writes that failed since the last look are logged."""
        stats = self._ps.stats()
        for message in self._checkpoint_failures.note(stats):
            logger.error("a checkpoint could not be written (%s); training goes on, the PS tries again "
                         "at its next checkpoint", message)
        return stats

    def _poll_version(self) -> int:
        try:
            return min(s.version for s in self._ps_stats())
        except grpc.RpcError:
            return 0  # a PS is restarting: ask again at the next poll (the controller ignores lower versions)

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

    def _epoch_logs(self) -> dict[str, float]:
        loss_sum, batches = self.progress.loss_sum, self.progress.batches
        mark_sum, mark_batches = self._epoch_loss_mark
        self._epoch_loss_mark = (loss_sum, batches)
        n = batches - mark_batches
        return {"loss": (loss_sum - mark_sum) / n} if n else {}

    def _epoch_telemetry(self, stats: list, epoch: int | None = None) -> dict:
        """Log the staleness summary since the last epoch's (or of the whole job, without an epoch)."""
        total = summarize(stats, self.clocks.blocked_seconds)
        if epoch is not None:
            since = total.minus(self._telemetry_mark)
            # One line per epoch only when something happened; the rest is in the job's line.
            level = logging.INFO if since.noteworthy else logging.DEBUG
            logger.log(level, "epoch %d consistency: %s", epoch + 1, since.describe())
            self._telemetry_mark = total
        else:
            logger.info("job consistency (%s): %s", self.config.consistency.description, total.describe())
        return total.to_dict()

    def _render(self, final: bool = False) -> None:
        if self.main_tasks is None:
            return
        epoch = self.main_tasks.epoch
        self.progress.render(epoch, self.main_tasks.epochs[epoch].records_done, final)

    def _finish(self, report: JobReport) -> None:
        """Final checkpoint, callbacks, export, prediction outputs."""
        from elasticdl.model.export import export_saved_model

        cfg = self.config
        self._step = "final model pull"
        report.model_version = max(self._sync_model(), self.model_version)
        if self.command == "train":
            if cfg.checkpoints.checkpoint_dir:
                self._step = "final checkpoint"
                try:
                    report.checkpoint = self._ps.save_checkpoint()[0]
                except grpc.RpcError as err:
                    raise JobFailedError(
                        f"the final checkpoint in --checkpoint_dir {cfg.checkpoints.checkpoint_dir} failed: "
                        f"{err.details()}"
                    ) from None
                logger.info("final checkpoint: %s", report.checkpoint)
            self._step = "on_train_end"
            self.callbacks.on_train_end({"model_version": report.model_version})
            if cfg.outputs.output:
                self._step = "export"
                try:
                    report.saved_model = export_saved_model(self._serving_model(), cfg.outputs.output)
                except OSError as err:
                    raise JobFailedError(
                        f"exporting the SavedModel to --output {cfg.outputs.output} failed: {err}"
                    ) from err
        if self.command == "predict" and self.checked.spec.prediction_outputs_processor is None:
            from elasticdl.model.prediction import join_parts

            self._step = "prediction join"
            shards = make_shards(self.checked.files, cfg.effective_records_per_task)
            try:
                report.predictions = join_parts(cfg.outputs.prediction_outputs, shards)
            except OSError as err:
                raise JobFailedError(
                    f"joining the predictions in --prediction_outputs {cfg.outputs.prediction_outputs} "
                    f"failed: {err}"
                ) from err
            logger.info("predictions: %s", report.predictions)
        self._step = "done"
        if self.evaluation is not None and self.evaluation.results:
            last = self.evaluation.results[-1]
            logger.info(
                "metrics of version %d: %s", last.model_version,
                ", ".join(f"{k}={v:.4f}" for k, v in last.metrics.items()),
            )


def _stops_early(callbacks) -> bool:
    """An early-stopping callback (ElasticDL's or Keras's) is among ``callbacks``."""
    import keras

    from elasticdl.callbacks import EarlyStopping

    return any(isinstance(cb, EarlyStopping | keras.callbacks.EarlyStopping) for cb in callbacks)
