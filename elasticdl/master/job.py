"""The master's job loop: start the roles, hand out tasks, watch, finish, export.

It decides; the backend carries out (starts and stops processes).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

from elasticdl.backends.local import LocalBackend, ProcessExit
from elasticdl.data.sources import make_shards
from elasticdl.grpc_utils import bind_local, make_server
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.servicer import MasterServicer
from elasticdl.master.task_manager import TaskManager
from elasticdl.master.telemetry import StalenessSummary, summarize
from elasticdl.preflight import CheckedJob
from elasticdl.proto import elasticdl_pb2_grpc

logger = logging.getLogger(__name__)

PS_START_TIMEOUT = 120.0


class JobFailedError(RuntimeError):
    """The job could not finish; the message says which role failed and why."""


@dataclass
class JobReport:
    job_name: str
    seconds: float = 0.0
    epochs: int = 0
    records_trained: int = 0
    model_version: int = 0
    final_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    saved_model: str = ""
    checkpoint: str = ""
    log_dir: str = ""
    dropped_tasks: int = 0
    consistency: str = ""
    staleness: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True)


class TrainingJob:
    def __init__(self, checked: CheckedJob, backend: LocalBackend | None = None, poll_seconds: float = 0.2):
        self.checked = checked
        self.config = checked.config
        self.backend = backend or LocalBackend(
            self.config.effective_log_dir, echo=self.config.log_level.upper() == "DEBUG"
        )
        self.poll_seconds = poll_seconds
        shards = make_shards(checked.files, self.config.effective_records_per_task)
        self.tasks = TaskManager(
            shards,
            num_epochs=self.config.num_epochs,
            task_timeout=self.config.task_timeout,
            max_task_retries=self.config.max_task_retries,
            seed=self.config.shuffle_seed,
        )
        self.progress = TrainingProgress(self.tasks.records_per_epoch, self.config.num_epochs)
        self.clocks = WorkerClocks()
        self._ps_client = None  # the master's own connection to the PS (telemetry, live workers)
        self._live_workers_told = -1
        self._epoch_seen = 0
        self._telemetry_at_epoch_start = StalenessSummary()
        self.ps_addresses: list[str] = []
        self.master_address = ""
        self._server = None

    def run(self) -> JobReport:
        started = time.monotonic()
        os.makedirs(self.config.effective_log_dir, exist_ok=True)
        master_log = logging.FileHandler(os.path.join(self.config.effective_log_dir, "master.log"))
        master_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [master] %(name)s: %(message)s"))
        logging.getLogger().addHandler(master_log)
        report = JobReport(
            self.config.job_name,
            log_dir=self.config.effective_log_dir,
            consistency=self.config.consistency_description,
        )
        try:
            self._start()
            self._watch()
            report.staleness = self._epoch_telemetry(final=True)
            report.checkpoint = self._finish(report)
        finally:
            self.backend.stop_all()
            if self._ps_client is not None:
                self._ps_client.close()
            logging.getLogger().removeHandler(master_log)
            master_log.close()
            if self._server is not None:
                self._server.stop(grace=1)
        report.seconds = round(time.monotonic() - started, 2)
        report.epochs = self.tasks.epoch + 1
        report.records_trained = self.progress.records_trained
        report.model_version = max(report.model_version, self.progress.model_version)
        report.final_loss = self.progress.recent_loss
        report.dropped_tasks = len(self.tasks.dropped_tasks())
        return report

    # ------------------------------------------------------------ steps

    def _start(self) -> None:
        cfg = self.config
        run_dir = cfg.run_dir
        os.makedirs(run_dir, exist_ok=True)
        config_file = os.path.join(run_dir, "job_config.json")
        with open(config_file, "w") as f:
            f.write(cfg.to_json())
        optimizer_file = os.path.join(run_dir, "optimizer.json")
        with open(optimizer_file, "w") as f:
            json.dump(self.checked.optimizer_spec.to_json_dict(), f)

        self._server = make_server()
        elasticdl_pb2_grpc.add_MasterServicer_to_server(MasterServicer(self.tasks, self.progress, self.clocks), self._server)
        port = bind_local(self._server)
        self._server.start()
        self.master_address = f"127.0.0.1:{port}"
        logger.info("master serving on %s; logs in %s", self.master_address, cfg.effective_log_dir)

        ready_files = []
        for ps_id in range(cfg.num_ps):
            ready = os.path.join(run_dir, f"ps-{ps_id}.port")
            if os.path.exists(ready):
                os.remove(ready)
            ready_files.append(ready)
            self.backend.start(
                "ps", ps_id,
                ["--job_config", config_file, "--optimizer_spec", optimizer_file,
                 "--ps_id", str(ps_id), "--ready_file", ready],
            )
        self.ps_addresses = [f"127.0.0.1:{port}" for port in self._wait_for_ps(ready_files)]
        logger.info("parameter servers at %s (%s)", ", ".join(self.ps_addresses), cfg.consistency_description)
        from elasticdl.worker.ps_client import PSClient

        self._ps_client = PSClient(self.ps_addresses)
        for worker_id in range(cfg.num_workers):
            self.backend.start(
                "worker", worker_id,
                ["--job_config", config_file, "--worker_id", str(worker_id),
                 "--master_addr", self.master_address, "--ps_addrs", ",".join(self.ps_addresses)],
            )
        logger.info("started %d workers", cfg.num_workers)

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
        last_render = 0.0
        render_every = 0.5 if self.progress.is_tty else 5.0
        failures: list[ProcessExit] = []
        while True:
            for exit_ in self.backend.poll_exits():
                if exit_.role == "ps":
                    raise JobFailedError(_describe_exit(exit_, "died"))
                if exit_.returncode != 0:
                    failures.append(exit_)
                    logger.error(_describe_exit(exit_, "died"))
                    self.tasks.recover_worker_tasks(exit_.index)
                self.clocks.forget(exit_.index)
            self._tell_ps_live_workers()
            if self.tasks.epoch != self._epoch_seen:
                self._epoch_telemetry()
            if not self.backend.running("worker"):
                if self.tasks.finished:
                    break
                first = failures[0] if failures else None
                raise JobFailedError(
                    "every worker exited before the training data was done"
                    + (f"; the first failure: {_describe_exit(first, 'died')}" if first else "")
                )
            now = time.monotonic()
            if now - last_render >= render_every:
                self._render()
                last_render = now
            time.sleep(self.poll_seconds)
        self._render(final=True)

    def _tell_ps_live_workers(self) -> None:
        """Sync mode: the PS averages over the workers holding a task, never waits for absent ones."""
        if self.config.use_async:
            return
        count = len(self.tasks.active_workers())
        if count and count != self._live_workers_told:
            self._ps_client.set_live_workers(count)
            self._live_workers_told = count

    def _epoch_telemetry(self, final: bool = False) -> dict:
        """Log the staleness summary of the epoch that ended (and of the job, when final)."""
        total = summarize(self._ps_client.stats(), self.clocks.blocked_seconds)
        epoch = total.minus(self._telemetry_at_epoch_start)
        ended = self._epoch_seen
        logger.info("epoch %d consistency: %s", ended + 1, epoch.describe())
        self._telemetry_at_epoch_start = total
        self._epoch_seen = self.tasks.epoch
        if final:
            logger.info("job consistency (%s): %s", self.config.consistency_description, total.describe())
        return total.to_dict()

    def _render(self, final: bool = False) -> None:
        epoch = self.tasks.epoch
        self.progress.render(epoch, self.tasks.epochs[epoch].records_done, final)

    def _finish(self, report: JobReport) -> str:
        """Final checkpoint, export, evaluation: the model comes from the PS."""
        from elasticdl.evaluation import evaluate
        from elasticdl.export import export_saved_model
        from elasticdl.preflight import check_eval_metrics
        from elasticdl.worker.trainer import Trainer

        cfg = self.config
        ps = self._ps_client
        checkpoint = ""
        if cfg.checkpoint_dir:
            checkpoint = ps.save_checkpoint()[0]
            logger.info("final checkpoint: %s", checkpoint)
        trainer = Trainer(self.checked.spec, cfg.model_params_dict)
        trainer.ensure_built(self.checked.sample_features)
        for pulled in ps.pull([-1] * ps.num_ps):
            trainer.set_params(pulled.params)
            report.model_version = max(report.model_version, pulled.version)
        if cfg.output:
            report.saved_model = export_saved_model(trainer.model, cfg.output)
        if cfg.validation_data:
            from elasticdl.data.sources import count_records, resolve_data_files

            has_header = bool(cfg.data_reader_params_dict.get("has_header", False))
            files = [(p, count_records(p, has_header)) for p in resolve_data_files(cfg.validation_data)]
            metrics = check_eval_metrics(self.checked.spec)
            if metrics:
                report.metrics = evaluate(
                    self.checked.spec, trainer.model, metrics, files, cfg.minibatch_size, has_header
                )
                logger.info(
                    "validation: %s", ", ".join(f"{k}={v:.4f}" for k, v in report.metrics.items())
                )
        return checkpoint


def _describe_exit(exit_: ProcessExit, what: str) -> str:
    tail = "\n".join("    " + line for line in exit_.log_tail.rstrip().splitlines()[-12:])
    return f"{exit_.role}-{exit_.index} {what} (exit code {exit_.returncode}); its last lines:\n{tail}"
