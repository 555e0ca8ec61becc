"""The master's job loop: start the roles, hand out tasks, watch, evaluate, finish.

It decides; the backend carries out (starts and stops processes). One loop serves the
three commands: ``train`` (training tasks, evaluation rounds at epoch ends and every
--evaluation_steps versions, callbacks, export), ``evaluate`` (one evaluation round of
a checkpoint) and ``predict`` (prediction tasks, outputs joined in input order).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from elasticdl.backends.local import LocalBackend, ProcessExit
from elasticdl.data.sources import count_records, make_shards, resolve_data_files
from elasticdl.grpc_utils import bind_local, make_server
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.evaluation_service import EvaluationResult, EvaluationService, TaskDispatcher
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.servicer import MasterServicer
from elasticdl.master.task_manager import TaskManager, TaskType
from elasticdl.master.telemetry import StalenessSummary, summarize
from elasticdl.preflight import CheckedJob, check_eval_metrics
from elasticdl.proto import elasticdl_pb2_grpc

logger = logging.getLogger(__name__)

PS_START_TIMEOUT = 120.0
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
        backend: LocalBackend | None = None,
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
        from elasticdl.export import export_saved_model

        self._sync_model()
        return export_saved_model(self._model, path)

    # ------------------------------------------------------------ run

    def run(self) -> JobReport:
        cfg = self.config
        started = time.monotonic()
        os.makedirs(cfg.effective_log_dir, exist_ok=True)
        master_log = logging.FileHandler(os.path.join(cfg.effective_log_dir, "master.log"))
        master_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [master] %(name)s: %(message)s"))
        logging.getLogger().addHandler(master_log)
        report = JobReport(
            cfg.job_name,
            command=self.command,
            log_dir=cfg.effective_log_dir,
            consistency=cfg.consistency_description if self.command == "train" else "",
            tensorboard_log_dir=cfg.tensorboard_log_dir,
        )
        try:
            self._start()
            self._watch()
            if self.command == "train":
                report.staleness = self._epoch_telemetry(final=True)
            self._finish(report)
        finally:
            self.backend.stop_all()
            if self._ps is not None:
                self._ps.close()
            if self._server is not None:
                self._server.stop(grace=1)
            if self.tensorboard is not None:
                self.tensorboard.close()
            logging.getLogger().removeHandler(master_log)
            master_log.close()
        report.seconds = round(time.monotonic() - started, 2)
        report.epochs = self.main_tasks.epoch + 1 if self.command == "train" else 0
        report.records_trained = self.progress.records_trained if self.command == "train" else 0
        report.model_version = max(report.model_version, self.model_version)
        report.final_loss = self.progress.recent_loss
        report.dropped_tasks = len(self.main_tasks.dropped_tasks()) if self.main_tasks else 0
        report.stopped_early = self._stop_reason
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
            MasterServicer(self.dispatcher, self.progress, self.clocks), self._server
        )
        port = bind_local(self._server)
        self._server.start()
        self.master_address = f"127.0.0.1:{port}"
        logger.info("master serving on %s; logs in %s", self.master_address, cfg.effective_log_dir)

        ready_files = []
        for ps_id in range(cfg.num_ps):
            ready = os.path.join(cfg.run_dir, f"ps-{ps_id}.port")
            if os.path.exists(ready):
                os.remove(ready)
            ready_files.append(ready)
            self.backend.start(
                "ps", ps_id,
                ["--job_config", config_file, "--optimizer_spec", optimizer_file,
                 "--ps_id", str(ps_id), "--ready_file", ready],
            )
        self.ps_addresses = [f"127.0.0.1:{port}" for port in self._wait_for_ps(ready_files)]
        logger.info(
            "parameter servers at %s%s", ", ".join(self.ps_addresses),
            f" ({cfg.consistency_description})" if self.command == "train" else "",
        )
        from elasticdl.worker.ps_client import PSClient
        from elasticdl.worker.trainer import Trainer

        self._ps = PSClient(self.ps_addresses)
        trainer = Trainer(self.checked.spec, cfg.model_params_dict)
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
        for worker_id in range(cfg.num_workers):
            self.backend.start(
                "worker", worker_id,
                ["--job_config", config_file, "--worker_id", str(worker_id), "--command", self.command,
                 "--master_addr", self.master_address, "--ps_addrs", ",".join(self.ps_addresses)],
            )
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
            drop_snapshot=self._ps.drop_snapshot,
            evaluation_steps=cfg.evaluation_steps,
            start_delay_secs=cfg.evaluation_start_delay_secs,
            throttle_secs=cfg.evaluation_throttle_secs,
            max_task_retries=cfg.max_task_retries,
            task_timeout=cfg.task_timeout,
        )
        self.dispatcher.evaluation = self.evaluation

    def _wait_for_ps(self, ready_files: list[str]) -> list[int]:
        deadline = time.monotonic() + PS_START_TIMEOUT
        while time.monotonic() < deadline:
            for exit_ in self.backend.poll_exits():
                raise JobFailedError(_describe_exit(exit_, "failed to start"))
            if all(os.path.exists(f) for f in ready_files):
                return [int(open(f).read()) for f in ready_files]
            time.sleep(0.05)
        raise JobFailedError(f"parameter servers did not start within {PS_START_TIMEOUT:.0f}s")

    def _watch(self) -> None:
        last_render = last_version_poll = 0.0
        render_every = 0.5 if self.progress.is_tty else 5.0
        failures: list[ProcessExit] = []
        while True:
            for exit_ in self.backend.poll_exits():
                if exit_.role == "ps":
                    raise JobFailedError(_describe_exit(exit_, "died"))
                if exit_.returncode != 0:
                    failures.append(exit_)
                    logger.error(_describe_exit(exit_, "died"))
                    self.dispatcher.recover_worker_tasks(exit_.index)
                self.clocks.forget(exit_.index)
            if not self.backend.running("worker"):
                if self._all_done():
                    break
                first = failures[0] if failures else None
                raise JobFailedError(
                    "every worker exited before the job was done"
                    + (f"; the first failure: {_describe_exit(first, 'died')}" if first else "")
                )
            self._tell_ps_live_workers()
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
                self._epoch_done += 1
                self._on_epoch_end(self._epoch_done, final=finished and self._epoch_done == tasks.epoch)
                if self._epoch_done < tasks.epoch:
                    self.callbacks.on_epoch_begin(self._epoch_done + 1)
        if self.evaluation is not None:
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

    def _on_epoch_end(self, epoch: int, final: bool) -> None:
        self._epoch_telemetry()
        if self.evaluation is not None:
            self._eval_queue.append(("final" if final else f"epoch {epoch + 1}", epoch))
        else:
            self._sync_model()
            self.callbacks.on_epoch_end(epoch, self._epoch_logs())

    def _on_evaluation(self, result: EvaluationResult) -> None:
        if self.tensorboard is not None:
            self.tensorboard.scalars(result.model_version, result.metrics, prefix="eval/")
        epoch = self._round_epochs.pop(result.round_id, None)
        if epoch is not None and self.callbacks is not None:
            self._sync_model()
            self.callbacks.on_epoch_end(epoch, {**self._epoch_logs(), **result.metrics})

    def _epoch_logs(self) -> dict[str, float]:
        loss_sum, batches = self.progress.loss_sum, self.progress.batches
        mark_sum, mark_batches = self._epoch_loss_mark
        self._epoch_loss_mark = (loss_sum, batches)
        n = batches - mark_batches
        return {"loss": (loss_sum - mark_sum) / n} if n else {}

    def _poll_version(self) -> int:
        return min(s.version for s in self._ps.stats())

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

    def _sync_model(self) -> None:
        """Pull the PS parameters into the master's model (for callbacks and export)."""
        for pulled in self._ps.pull([-1] * self._ps.num_ps):
            self._trainer.set_params(pulled.params)
            self.model_version = max(self.model_version, pulled.version)

    def _tell_ps_live_workers(self) -> None:
        """Sync mode: the PS averages over the workers holding a task, never waits for absent ones."""
        if self.config.use_async or self.command != "train":
            return
        count = len(self.dispatcher.active_workers())
        if count and count != self._live_workers_told:
            self._ps.set_live_workers(count)
            self._live_workers_told = count

    def _epoch_telemetry(self, final: bool = False) -> dict:
        """Log the staleness summary since the last call (and of the whole job, when final)."""
        total = summarize(self._ps.stats(), self.clocks.blocked_seconds)
        if not final:
            since = total.minus(self._telemetry_mark)
            logger.info("epoch %d consistency: %s", self._epoch_done + 1, since.describe())
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
                report.saved_model = export_saved_model(self._model, cfg.output)
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
