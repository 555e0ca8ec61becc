"""How a job starts: the master's gRPC server, the parameter servers, the master's own model,
the evaluation service, TensorBoard and callbacks, the controller, and the first workers.

A part of the job's executor (``Job`` in elasticdl/master/job.py), in its own module.
"""

from __future__ import annotations

import json
import logging
import os
import time

from elasticdl import fs
from elasticdl.config import JobConfig
from elasticdl.data.sources import count_records, make_shards, resolve_data_files
from elasticdl.errors import JobFailedError
from elasticdl.launch.api import RoleExitedError
from elasticdl.master import controller as c
from elasticdl.master.evaluation_service import EvaluationService
from elasticdl.master.preflight import check_eval_metrics
from elasticdl.master.ps_probe import PSProbe
from elasticdl.master.servicer import MasterServicer
from elasticdl.proto import elasticdl_pb2_grpc
from elasticdl.rpc import auth, trust
from elasticdl.rpc.channel import make_server

logger = logging.getLogger(__name__)

PS_START_TIMEOUT = 120.0
# The master looks at its PS this often, for the versions no worker reports (for example while
# every worker evaluates) and for a PS that stopped answering.
VERSION_POLL_SECONDS = 0.5


def write_job_config(config: JobConfig) -> str:
    """runs/<job>/job_config.json, every role's ``--job_config``; its path. Owner-only (0600):
    it holds the --envs values, which count as secrets."""
    os.makedirs(config.job.run_dir, exist_ok=True)
    return auth.write_private(os.path.join(config.job.run_dir, "job_config.json"), config.to_json())


class JobSetup:
    """The start of a job (a part of ``Job``)."""

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
        servicer = MasterServicer(self.requests, self.clocks, lambda: self.desk.active_workers,
                                  scale=self.request_scale, stop=self.request_stop,
                                  job_key=self.backend.job_key(),  # worker credentials, tickets (rpc/trust.py)
                                  preprocessing_state=lambda: self._preprocessing_state)
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
        from elasticdl.model.preprocessing_state import hand_off

        # Every worker preprocesses as this model does: it asks for this state before it builds its own.
        self._preprocessing_state = hand_off(self.checked.spec, self._model).to_bytes()
        self.ps_addresses = self._wait_for_ps()
        logger.info(
            "parameter servers at %s%s", ", ".join(self.ps_addresses),
            f" ({cfg.consistency.description})" if self.command == "train" else "",
        )
        self._ps = PSClient(self.ps_addresses, token=self._token,  # the master's commands need its credential
                            master_credential=trust.master_credential(self.backend.job_key()),
                            replicas=cfg.elasticity.ps_replicas,
                            slice_dense_above_mb=cfg.training.slice_dense_above_mb)
        self._configure_replicas()  # --ps_replicas: each PS forwards to its backups from now on
        self._ps.term = self.state.term
        self._probe = PSProbe(self._ps, VERSION_POLL_SECONDS, time.monotonic, on_stats=self._note_stats)
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
            wait_for_epoch_callbacks=_stops_early(user_callbacks), replica_roles=self._replica_roles(),
            saves_checkpoints=bool(cfg.checkpoints.checkpoint_dir),
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


def _stops_early(callbacks) -> bool:
    """An early-stopping callback (ElasticDL's or Keras's) is among ``callbacks``."""
    import keras

    from elasticdl.callbacks import EarlyStopping

    return any(isinstance(cb, EarlyStopping | keras.callbacks.EarlyStopping) for cb in callbacks)
