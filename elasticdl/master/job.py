"""The master's job loop: start the roles, hand out tasks, watch, evaluate, finish.

It decides; the backend carries out (starts and stops processes). One loop serves the
three commands: ``train`` (training tasks, evaluation rounds at epoch ends and every
--evaluation_steps versions, callbacks, export), ``evaluate`` (one evaluation round of
a checkpoint) and ``predict`` (prediction tasks, outputs joined in input order).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from elasticdl.backends.api import Backend, RoleExitedError
from elasticdl.backends.local import LocalBackend, ProcessExit
from elasticdl.data.sources import count_records, make_shards, resolve_data_files
from elasticdl.grpc_utils import make_server
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.evaluation_service import EvaluationResult, EvaluationService, TaskDispatcher
from elasticdl.master.instance_manager import GiveUp, InstanceManager, Launch, Stop
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.servicer import MasterServicer
from elasticdl.master.task_manager import TaskManager, TaskType
from elasticdl.master.telemetry import StalenessSummary, summarize
from elasticdl.preflight import CheckedJob, check_eval_metrics
from elasticdl.proto import elasticdl_pb2_grpc

logger = logging.getLogger(__name__)

PS_START_TIMEOUT = 120.0
# A worker asked to leave (scale-down) gets this long to finish its batch and report.
WORKER_STOP_GRACE_SECS = 30.0
# A parameter server is relaunched (from the latest checkpoint) at most this many times.
MAX_PS_RELAUNCHES = 3
# The master's leader lock in etcd expires this long after the master dies.
LEADER_LEASE_SECS = 5.0
VERSION_POLL_SECONDS = 0.5


class JobFailedError(RuntimeError):
    """The job could not finish; the message says which role failed and why."""


@dataclass
class JobReport:
    job_name: str
    command: str = "train"
    seconds: float = 0.0
    epochs: int = 0
    records_trained: int = 0
    model_version: int = 0
    final_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    evaluations: list[dict] = field(default_factory=list)
    saved_model: str = ""
    checkpoint: str = ""
    predictions: str = ""
    log_dir: str = ""
    report_file: str = ""
    tensorboard_log_dir: str = ""
    dropped_tasks: int = 0
    stopped_early: str = ""
    # Elasticity: per epoch, records trained more than once (from tasks whose worker was
    # killed or failed mid-task; a graceful preemption adds none).
    records_trained_twice: list[int] = field(default_factory=list)
    records_done_per_epoch: list[int] = field(default_factory=list)  # each epoch's distinct records
    records_per_epoch: int = 0
    tasks_interrupted: int = 0
    worker_relaunches: int = 0
    worker_preemptions: int = 0
    ps_relaunches: int = 0
    state_store: str = "memory"
    resumed: bool = False  # continued a ledger a previous master left in etcd
    etcd_outages: list[dict] = field(default_factory=list)
    consistency: str = ""
    staleness: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


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
        self.backend = backend or LocalBackend(cfg.effective_log_dir, echo=cfg.log_level.upper() == "DEBUG")
        self.poll_seconds = poll_seconds
        self.has_header = bool(cfg.data_reader_params_dict.get("has_header", False))

        self.main_tasks: TaskManager | None = None
        if command == "train":
            self.main_tasks = TaskManager(
                make_shards(checked.files, cfg.effective_records_per_task),
                num_epochs=cfg.num_epochs,
                task_timeout=cfg.task_timeout,
                max_task_retries=cfg.max_task_retries,
                seed=cfg.shuffle_seed,
            )
        elif command == "predict":
            self.main_tasks = TaskManager(
                make_shards(checked.files, cfg.effective_records_per_task),
                task_timeout=cfg.task_timeout,
                max_task_retries=cfg.max_task_retries,
                task_type=TaskType.PREDICTION,
                shuffle=False,
            )
        records = sum(n for _, n in checked.files)
        self.progress = TrainingProgress(records, cfg.num_epochs if command == "train" else 1)
        self.clocks = WorkerClocks()
        self.instances = InstanceManager(
            cfg.num_workers,
            cfg.worker_pod_priority,
            cfg.relaunch_on_worker_failure,
        )
        self._scale_request: int | None = None  # set by the gRPC thread, applied by the loop
        self._worker_args: list[str] = []
        self._ps_args: dict[int, list[str]] = {}
        self._ps_relaunches = 0
        self._store = None  # where the task ledger lives (etcd, or memory)
        self._ledger = None  # its writer (etcd only)
        self._leadership = None
        self._saved_seq = -1
        self._resumed = False
        self._store_failure = ""
        self._succeeded = False
        self.evaluation: EvaluationService | None = None
        self.dispatcher = TaskDispatcher(self.main_tasks, None)
        self.ps_addresses: list[str] = []
        self.master_address = ""
        self._server = None
        self._ps = None  # the master's own PSClient
        self._model = None  # the master's copy of the model (callbacks, export)
        self.callbacks = None
        self.tensorboard = None
        self.model_version = 0
        self._live_workers_told = -1
        self._epoch_done = -1  # the last training epoch whose end was handled
        self._epoch_loss_mark = (0.0, 0)
        self._eval_queue: list[tuple[str, int | None]] = []  # (reason, epoch) waiting to start
        self._round_epochs: dict[int, int | None] = {}
        self._telemetry_mark = StalenessSummary()
        self._stop_reason = ""

    # ------------------------------------------------------------ JobControl (callbacks)

    def stop_training(self, reason: str) -> None:
        if self.main_tasks is not None and not self._stop_reason:
            self._stop_reason = reason
            dropped = self.main_tasks.stop()
            logger.info("%s: stopping training (%d tasks not started are dropped)", reason, dropped)

    def set_learning_rate(self, learning_rate: float) -> None:
        self._ps.set_learning_rate(learning_rate)

    def export(self, path: str) -> str:
        """Export the parameters the callbacks see now (those evaluated, at an epoch end)."""
        from elasticdl.export import export_saved_model

        return export_saved_model(self._serving_model(), path)

    # ------------------------------------------------------------ run

    def run(self) -> JobReport:
        cfg = self.config
        started = time.monotonic()
        os.makedirs(cfg.effective_log_dir, exist_ok=True)
        master_log = logging.FileHandler(os.path.join(cfg.effective_log_dir, "master.log"))
        master_log.setFormatter(
            logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s [master] %(name)s: %(message)s", "%H:%M:%S")
        )
        logging.getLogger().addHandler(master_log)
        report = JobReport(
            cfg.job_name,
            command=self.command,
            log_dir=cfg.effective_log_dir,
            consistency=cfg.consistency_description if self.command == "train" else "",
            tensorboard_log_dir=cfg.tensorboard_log_dir,
        )
        try:
            self._open_state_store()
            self._start()
            self._watch()
            if self.command == "train":
                report.staleness = self._epoch_telemetry(self._ps.stats())
            self._finish(report)
            self._succeeded = True
        finally:
            self.backend.stop_all()
            if self._ps is not None:
                self._ps.close()
            if self._server is not None:
                self._server.stop(grace=1)
            if self.tensorboard is not None:
                self.tensorboard.close()
            self._close_state_store(success=self._succeeded)
            logging.getLogger().removeHandler(master_log)
            master_log.close()
        report.seconds = round(time.monotonic() - started, 2)
        report.epochs = self.main_tasks.epoch + 1 if self.command == "train" else 0
        report.records_trained = self.progress.records_trained if self.command == "train" else 0
        report.model_version = max(report.model_version, self.model_version)
        report.final_loss = self.progress.recent_loss if self.command == "train" else None
        report.dropped_tasks = len(self.main_tasks.dropped_tasks()) if self.main_tasks else 0
        report.stopped_early = self._stop_reason
        if self.main_tasks is not None and self.command == "train":
            report.records_trained_twice = [e.records_trained_twice for e in self.main_tasks.epochs]
            report.records_done_per_epoch = [e.records_done for e in self.main_tasks.epochs]
            report.records_per_epoch = self.main_tasks.records_per_epoch
            report.tasks_interrupted = sum(e.tasks_interrupted for e in self.main_tasks.epochs)
        report.worker_relaunches = self.instances.relaunches
        report.worker_preemptions = self.instances.preemptions
        report.ps_relaunches = self._ps_relaunches
        report.state_store = "etcd" if cfg.etcd_endpoints else "memory"
        report.resumed = self._resumed
        if self._ledger is not None:
            report.etcd_outages = [
                {"seconds": round(o.seconds, 2), "error": o.error, "snapshots_kept": o.snapshots_kept}
                for o in self._ledger.outages
            ]
        if self.evaluation is not None:
            report.evaluations = [
                {"model_version": r.model_version, "reason": r.reason, "records": r.records, "metrics": r.metrics}
                for r in self.evaluation.results
            ]
            if self.evaluation.results:
                report.metrics = self.evaluation.results[-1].metrics
        report.report_file = os.path.abspath(os.path.join(cfg.run_dir, "report.json"))
        with open(report.report_file, "w") as f:
            f.write(report.to_json())
        return report

    # ------------------------------------------------------------ steps

    def _start(self) -> None:
        cfg = self.config
        os.makedirs(cfg.run_dir, exist_ok=True)
        config_file = os.path.join(cfg.run_dir, "job_config.json")
        with open(config_file, "w") as f:
            f.write(cfg.to_json())
        optimizer_file = os.path.join(cfg.run_dir, "optimizer.json")
        with open(optimizer_file, "w") as f:
            json.dump(self.checked.optimizer_spec.to_json_dict(), f)

        self._server = make_server()
        elasticdl_pb2_grpc.add_MasterServicer_to_server(
            MasterServicer(self.dispatcher, self.progress, self.clocks, scale=self.request_scale), self._server
        )
        self.master_address = self.backend.bind_master(self._server)
        self._server.start()
        with open(os.path.join(cfg.run_dir, "master.addr"), "w") as f:
            f.write(self.master_address)  # `elasticdl scale --job_name` finds the master here
        if self._store is not None:
            self._store.publish_address("master", 0, self.master_address)
        logger.info("master serving on %s; logs in %s", self.master_address, cfg.effective_log_dir)

        for ps_id in range(cfg.num_ps):
            self._ps_args[ps_id] = ["--job_config", config_file, "--optimizer_spec", optimizer_file,
                                    "--ps_id", str(ps_id)]
            self.backend.start("ps", ps_id, self._ps_args[ps_id])
        self.ps_addresses = self._wait_for_ps()
        logger.info(
            "parameter servers at %s%s", ", ".join(self.ps_addresses),
            f" ({cfg.consistency_description})" if self.command == "train" else "",
        )
        from elasticdl.worker.ps_client import PSClient
        from elasticdl.worker.trainer import Trainer

        self._ps = PSClient(self.ps_addresses)
        trainer = Trainer(self.checked.spec, cfg.model_params_dict, cfg.embedding_swap_threshold_mb)
        trainer.ensure_built(self.checked.sample_features)
        self._trainer = trainer
        self._model = trainer.model
        self._model.stop_training = False  # Keras callbacks set it to end training
        self._start_evaluation_service()
        if cfg.tensorboard_log_dir:
            from elasticdl.master.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(cfg.tensorboard_log_dir)
            logger.info("TensorBoard: tensorboard --logdir %s", cfg.tensorboard_log_dir)
        if self.command == "train":
            from elasticdl.callbacks import CallbackList

            user_callbacks = self.checked.spec.callbacks() if self.checked.spec.callbacks else []
            self.callbacks = CallbackList(user_callbacks, model=self._model, job=self)
            self.callbacks.on_train_begin()
            self.callbacks.on_epoch_begin(0)
        if self.command == "evaluate":
            self._eval_queue.append(("evaluate", None))
        if self.command == "predict":
            import shutil

            from elasticdl.prediction import PARTS

            # Parts left by an earlier run must never be joined into this one's output.
            shutil.rmtree(os.path.join(cfg.prediction_outputs, PARTS), ignore_errors=True)
        self._worker_args = ["--job_config", config_file, "--command", self.command,
                             "--master_addr", self.master_address, "--ps_addrs", ",".join(self.ps_addresses)]
        self._apply(self.instances.initial())
        logger.info("started %d workers", cfg.num_workers)

    def _start_evaluation_service(self) -> None:
        cfg = self.config
        if self.command not in ("train", "evaluate") or not cfg.validation_data:
            return
        metrics = check_eval_metrics(self.checked.spec)
        if not metrics:
            return
        files = [(p, count_records(p, self.has_header)) for p in resolve_data_files(cfg.validation_data)]
        self.evaluation = EvaluationService(
            make_shards(files, cfg.effective_records_per_task),
            metrics_fn=self.checked.spec.eval_metrics_fn,
            snapshot=self._ps.take_snapshot,
            evaluation_steps=cfg.evaluation_steps,
            start_delay_secs=cfg.evaluation_start_delay_secs,
            throttle_secs=cfg.evaluation_throttle_secs,
            max_task_retries=cfg.max_task_retries,
            task_timeout=cfg.task_timeout,
        )
        self.dispatcher.evaluation = self.evaluation

    def _wait_for_ps(self) -> list[str]:
        """The backend knows where its PS serve (local: ready files; Kubernetes: their services)."""
        try:
            return self.backend.ps_addresses(self.config.num_ps, PS_START_TIMEOUT)
        except RoleExitedError as err:
            raise JobFailedError(_describe_exit(err.exit, "failed to start")) from None
        except TimeoutError as err:
            raise JobFailedError(str(err)) from None

    def _watch(self) -> None:
        last_render = last_version_poll = 0.0
        render_every = 0.5 if self.progress.is_tty else 5.0
        failures: list[ProcessExit] = []
        while True:
            for exit_ in self.backend.poll_exits():
                if exit_.role == "ps":
                    self._relaunch_ps(exit_)
                    continue
                if exit_.returncode != 0:
                    failures.append(exit_)
                    logger.error(_describe_exit(exit_, "exited"))
                self.dispatcher.recover_worker_tasks(exit_.index)
                self.clocks.forget(exit_.index)
                self._apply(self.instances.on_exit(
                    exit_.index, exit_.returncode, exit_.log_tail, job_done=self.dispatcher.finished
                ))
            if self._scale_request is not None:
                desired, self._scale_request = self._scale_request, None
                logger.info("scaling to %d workers (from %d)", desired, self.instances.desired)
                self._apply(self.instances.scale(desired))
            if not self.backend.running("worker"):
                if self._all_done():
                    break
                if self.instances.desired == 0:
                    time.sleep(self.poll_seconds)  # scaled to zero: wait for `elasticdl scale`
                    continue
                first = failures[0] if failures else None
                raise JobFailedError(
                    "every worker exited before the job was done"
                    + (f"; the first failure: {_describe_exit(first, 'died')}" if first else "")
                )
            self._tell_ps_live_workers()
            self._save_ledger()
            now = time.monotonic()
            if now - last_version_poll >= VERSION_POLL_SECONDS:
                self._on_version(self._poll_version())
                last_version_poll = now
            self._advance()
            if now - last_render >= render_every:
                self._render()
                last_render = now
            time.sleep(self.poll_seconds)
        self._render(final=True)

    def _fingerprint(self) -> str:
        """What makes a ledger this job's: its data, task size, epochs and model."""
        import hashlib

        cfg = self.config
        text = json.dumps([self.checked.files, cfg.effective_records_per_task, cfg.num_epochs, cfg.model_def])
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def _open_state_store(self) -> None:
        """Take the job's leader lock and resume its ledger (etcd), or keep state in memory."""
        from elasticdl.master import state_store

        cfg = self.config
        if not cfg.etcd_endpoints or self.command != "train":
            logger.info("job state in memory (no --etcd_endpoints): a restarted master starts over")
            return
        self._store = state_store.EtcdStateStore(cfg.etcd_endpoints, cfg.job_name)
        try:
            # Wait a little: a master restarted after a crash finds its predecessor's lease
            # still alive until it expires.
            self._leadership = self._store.acquire_leadership(
                f"{os.uname().nodename}:{os.getpid()}", ttl=LEADER_LEASE_SECS, wait=2 * LEADER_LEASE_SECS,
                on_lost=lambda why: self._fail_from_store(f"lost the leader lock: {why}"),
            )
        except state_store.LeadershipError as err:
            raise JobFailedError(str(err)) from None
        except state_store.StoreUnavailableError as err:
            raise JobFailedError(f"etcd at {cfg.etcd_endpoints} is unreachable: {err}") from None
        self._ledger = state_store.ResilientStore(
            self._store,
            on_outage=lambda o: logger.warning("etcd was unreachable for %.1fs; the ledger is written again", o.seconds),
            on_fatal=lambda err: self._fail_from_store(str(err)),
        )
        snapshot = self._ledger.load_ledger()
        logger.info("job state in etcd at %s under /elasticdl/%s/", cfg.etcd_endpoints, cfg.job_name)
        if snapshot is None:
            return
        if snapshot.job_fingerprint != self._fingerprint():
            raise JobFailedError(
                f"etcd holds a ledger for a different job named {cfg.job_name!r} (other data, task size, "
                "epochs or model). Use another --job_name."
            )
        self.main_tasks.restore(snapshot)
        self._resumed = True
        if cfg.checkpoint_dir:
            from elasticdl.ps import checkpoint

            if checkpoint.complete_versions(cfg.checkpoint_dir):
                # The PS come back from the latest checkpoint: updates since then are lost.
                self.config = dataclasses.replace(cfg, checkpoint_dir_for_init=cfg.checkpoint_dir)
                logger.info("the parameter servers restore the latest checkpoint in %s", cfg.checkpoint_dir)

    def _fail_from_store(self, why: str) -> None:
        self._store_failure = why  # the loop raises it (this runs on a store thread)

    def _save_ledger(self) -> None:
        if self._store_failure:
            raise JobFailedError(f"the job state in etcd cannot be trusted any more: {self._store_failure}")
        if self._ledger is None or self.main_tasks.seq == self._saved_seq:
            return
        snapshot = self.main_tasks.snapshot(self._fingerprint())
        self._ledger.save(snapshot)
        self._saved_seq = snapshot.seq

    def _close_state_store(self, success: bool) -> None:
        if self._store is None:
            return
        try:
            if self._ledger is not None:
                if success and self.main_tasks.finished and self.dispatcher.finished:
                    self._ledger.close()
                    self._store.clear_ledger()  # done: a new run with this name starts fresh
                else:
                    self._save_ledger_quietly()
                    self._ledger.close()
            self._store.close()
        except Exception as err:  # never mask the job's own outcome
            logger.warning("closing the etcd state store: %s", err)

    def _save_ledger_quietly(self) -> None:
        try:
            self._save_ledger()
        except JobFailedError:
            pass

    def request_scale(self, num_workers: int) -> str:
        """`elasticdl scale`: change the desired number of workers (any thread)."""
        if self.command != "train":
            raise ValueError("only training jobs can be scaled")
        if num_workers < 0:
            raise ValueError(f"--num_workers must be 0 or more. Received: {num_workers}")
        self._scale_request = num_workers
        return f"scaling job {self.config.job_name} to {num_workers} workers"

    def _apply(self, decisions) -> None:
        for decision in decisions:
            if isinstance(decision, Launch):
                self.backend.start("worker", decision.index, [*self._worker_args, "--worker_id", str(decision.index)],
                                   priority=str(decision.priority))  # Kubernetes: the pod's PriorityClass
                logger.info("worker %d started (%s priority)", decision.index, decision.priority)
            elif isinstance(decision, Stop):
                logger.info("asking worker %d to leave (scale-down)", decision.index)
                self.backend.request_stop("worker", decision.index, WORKER_STOP_GRACE_SECS)
            elif isinstance(decision, GiveUp):
                raise JobFailedError(decision.error)

    def _relaunch_ps(self, exit_: ProcessExit) -> None:
        """A dead PS comes back on the same address, from the latest checkpoint if there is one."""
        cfg = self.config
        if self.dispatcher.finished:
            return
        self._ps_relaunches += 1
        if self._ps_relaunches > MAX_PS_RELAUNCHES or self.command != "train":
            raise JobFailedError(_describe_exit(exit_, "died"))
        from elasticdl.ps import checkpoint

        args = list(self._ps_args[exit_.index])
        port = self.ps_addresses[exit_.index].rsplit(":", 1)[1]
        args += ["--port", port]
        restore = ""
        if cfg.checkpoint_dir and checkpoint.complete_versions(cfg.checkpoint_dir):
            restore = cfg.checkpoint_dir
            args += ["--restore_from", restore]
        logger.error(
            "%s; relaunching it on port %s %s", _describe_exit(exit_, "died"), port,
            f"from the latest checkpoint in {restore} (updates since then are lost)" if restore
            else "empty: the workers give it their copy of its variables (no --checkpoint_dir)",
        )
        self.backend.start("ps", exit_.index, args)
        if self.evaluation is not None and self.evaluation.busy:
            self.evaluation.suspend()  # its snapshot died with the PS: run the round again once it is back

    def _all_done(self) -> bool:
        """Training (or prediction) finished, its last epoch's end handled, no evaluation left.

        The epoch check matters: the last task may be reported between two looks at the
        task manager, and the final evaluation is only queued when the epoch end is handled.
        """
        if not self.dispatcher.main_finished:
            return False
        if self.command == "train" and self._epoch_done < self.main_tasks.epoch:
            return False
        return not self._eval_queue and not (self.evaluation and self.evaluation.busy)

    def _advance(self) -> None:
        """Epoch ends, evaluation rounds, and the end of the job: one step of the state machine."""
        tasks = self.main_tasks
        if self.command == "train":
            if getattr(self._model, "stop_training", False):  # e.g. keras.callbacks.EarlyStopping
                self._model.stop_training = False
                self.stop_training("a callback set model.stop_training")
            finished = tasks.finished
            last_complete = tasks.epoch - 1 if not finished else tasks.epoch
            while self._epoch_done < last_complete:
                epoch = self._epoch_done + 1
                if not self._on_epoch_end(epoch, final=finished and epoch == tasks.epoch):
                    return  # a PS is restarting: handle the epoch end at a later poll
                self._epoch_done = epoch
                if self._epoch_done < tasks.epoch:
                    self.callbacks.on_epoch_begin(self._epoch_done + 1)
        if self.evaluation is not None:
            if self.evaluation.busy and self.evaluation.current.suspended and not self._restart_evaluation():
                return  # the relaunched PS is not serving yet
            result = self.evaluation.poll()
            if result is not None:
                self._on_evaluation(result)
            if not self.evaluation.busy and self._eval_queue:
                reason, epoch = self._eval_queue.pop(0)
                self._round_epochs[self.evaluation.start(reason).round_id] = epoch
            elif self.evaluation.due(self.model_version):
                self._round_epochs[self.evaluation.start(f"every {self.config.evaluation_steps} versions").round_id] = None
        if self._all_done():
            self.dispatcher.finish()  # workers get END and exit

    def _on_epoch_end(self, epoch: int, final: bool) -> bool:
        """Telemetry, then evaluation or callbacks; False (nothing done) while a PS is unreachable."""
        import grpc

        try:  # every PS call first, so that a PS restart leaves nothing half done
            stats = self._ps.stats()
            if self.evaluation is None:
                self._sync_model()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            logger.info("end of epoch %d waits for a restarting PS", epoch + 1)
            return False
        self._epoch_telemetry(stats, epoch)
        if self.evaluation is not None:
            self._eval_queue.append(("final" if final else f"epoch {epoch + 1}", epoch))
        else:
            self.callbacks.on_epoch_end(epoch, self._epoch_logs())
        return True

    def _restart_evaluation(self) -> bool:
        """A suspended round runs again on a fresh snapshot; False while a PS is unreachable."""
        import grpc

        try:
            lost = self.evaluation.restart()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return False
        self._round_epochs[self.evaluation.current.round_id] = self._round_epochs.pop(lost, None)
        try:
            self._ps.drop_snapshot(lost)  # still held by the PS that did not restart
        except grpc.RpcError:
            pass  # a PS restarting again: its snapshots are gone anyway
        logger.warning("a PS restarted during evaluation round %d: evaluating again", lost)
        return True

    def _on_evaluation(self, result: EvaluationResult) -> None:
        if self.tensorboard is not None:
            self.tensorboard.scalars(result.model_version, result.metrics, prefix="eval/")
        epoch = self._round_epochs.pop(result.round_id, None)
        if epoch is not None and self.callbacks is not None:
            # The callbacks see the parameters that were evaluated, not newer ones.
            for pulled in self._ps.pull_snapshot(result.round_id):
                self._trainer.set_params(pulled.params)
            self.callbacks.on_epoch_end(epoch, {**self._epoch_logs(), **result.metrics})
        self._ps.drop_snapshot(result.round_id)

    def _epoch_logs(self) -> dict[str, float]:
        loss_sum, batches = self.progress.loss_sum, self.progress.batches
        mark_sum, mark_batches = self._epoch_loss_mark
        self._epoch_loss_mark = (loss_sum, batches)
        n = batches - mark_batches
        return {"loss": (loss_sum - mark_sum) / n} if n else {}

    def _poll_version(self) -> int:
        import grpc

        try:
            return min(s.version for s in self._ps.stats())
        except grpc.RpcError:
            return self.model_version  # a PS is restarting: ask again at the next poll

    def _on_version(self, version: int) -> None:
        if version == self.model_version:
            return
        self.model_version = version
        if self.callbacks is not None:
            self.callbacks.on_model_version(version)
        if self.tensorboard is not None:
            self.tensorboard.scalars(version, {
                "train/loss": self.progress.recent_loss,
                "train/examples_per_second": self.progress.examples_per_second,
                "train/live_workers": len(self.backend.running("worker")),
            })

    def _serving_model(self):
        """The master's model with its embedding tables pulled in from the PS (serving needs no PS)."""
        return self._trainer.serving_model(self._ps.pull_embedding_table)

    def _sync_model(self) -> None:
        """Pull the PS parameters into the master's model (for callbacks and export)."""
        for pulled in self._ps.pull([-1] * self._ps.num_ps):
            self._trainer.set_params(pulled.params)
            self.model_version = max(self.model_version, pulled.version)

    def _tell_ps_live_workers(self) -> None:
        """Sync mode: the PS averages over the workers holding a task, never waits for absent ones."""
        if self.config.use_async or self.command != "train":
            return
        import grpc

        count = len(self.dispatcher.active_workers())
        if count and count != self._live_workers_told:
            try:
                self._ps.set_live_workers(count)
            except grpc.RpcError:
                return  # a PS is restarting: tell it at the next poll
            self._live_workers_told = count

    def _epoch_telemetry(self, stats: list, epoch: int | None = None) -> dict:
        """Log the staleness summary since the last epoch's (or of the whole job, without an epoch)."""
        total = summarize(stats, self.clocks.blocked_seconds)
        if epoch is not None:
            since = total.minus(self._telemetry_mark)
            logger.info("epoch %d consistency: %s", epoch + 1, since.describe())
            self._telemetry_mark = total
        else:
            logger.info("job consistency (%s): %s", self.config.consistency_description, total.describe())
        return total.to_dict()

    def _render(self, final: bool = False) -> None:
        if self.main_tasks is None:
            return
        epoch = self.main_tasks.epoch
        self.progress.render(epoch, self.main_tasks.epochs[epoch].records_done, final)

    def _finish(self, report: JobReport) -> None:
        """Final checkpoint, callbacks, export, prediction outputs."""
        from elasticdl.export import export_saved_model

        cfg = self.config
        self._sync_model()
        report.model_version = self.model_version
        if self.command == "train":
            if cfg.checkpoint_dir:
                report.checkpoint = self._ps.save_checkpoint()[0]
                logger.info("final checkpoint: %s", report.checkpoint)
            self.callbacks.on_train_end({"model_version": self.model_version})
            if cfg.output:
                report.saved_model = export_saved_model(self._serving_model(), cfg.output)
        if self.command == "predict" and self.checked.spec.prediction_outputs_processor is None:
            from elasticdl.prediction import join_parts

            shards = make_shards(self.checked.files, cfg.effective_records_per_task)
            report.predictions = join_parts(cfg.prediction_outputs, shards)
            logger.info("predictions: %s", report.predictions)
        if self.evaluation is not None and self.evaluation.results:
            last = self.evaluation.results[-1]
            logger.info(
                "metrics of version %d: %s", last.model_version,
                ", ".join(f"{k}={v:.4f}" for k, v in last.metrics.items()),
            )


def _describe_exit(exit_: ProcessExit, what: str) -> str:
    tail = "\n".join("    " + line for line in exit_.log_tail.rstrip().splitlines()[-12:])
    return f"{exit_.role}-{exit_.index} {what} (exit code {exit_.returncode}); its last lines:\n{tail}"
