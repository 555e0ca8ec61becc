"""Typed job configuration: one dataclass, validated before any process starts.

Every field carries its command-line help in ``metadata``; ``elasticdl.cli`` builds
the argument parser from these fields, so the CLI, the Python API and the generated
CLI reference (docs/cli.md) cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from elasticdl.errors import UserError

BACKENDS = ("local", "kubernetes")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
COMMANDS = ("train", "evaluate", "predict")


class ConfigError(UserError, ValueError):
    """A flag or flag combination that cannot work; the message names the flag and the fix."""


def _flag(default: Any, help: str, commands: tuple[str, ...] = COMMANDS, aliases: tuple[str, ...] = ()):
    return field(default=default, metadata={"help": help, "commands": commands, "aliases": aliases})


@dataclass
class JobConfig:
    """Everything a job needs. Build it with the CLI, ``elasticdl.train(...)`` or directly."""

    # The model zoo.
    model_zoo: str = _flag("", "Directory that holds the model-zoo packages (required).")
    model_def: str = _flag(
        "",
        "The model function or class, as pkg.module.name under --model_zoo "
        "(e.g. digits.digits_functional.custom_model; required).",
    )
    model_params: str = _flag(
        "", "Keyword arguments for the model function: \"a=1;b=2.5;c='x'\"."
    )

    # Data.
    training_data: str = _flag(
        "",
        "Training data: a file, a directory, a glob, or several separated by commas "
        "(TFRecord of tf.train.Example, or .csv/.txt lines).",
        commands=("train",),
    )
    validation_data: str = _flag(
        "",
        "Validation data (same forms as --training_data), evaluated with eval_metrics_fn() "
        "at each epoch's end, every --evaluation_steps versions, and when training ends.",
        commands=("train", "evaluate"),
    )
    prediction_data: str = _flag(
        "", "Data to predict on (same forms as --training_data).", commands=("predict",)
    )
    prediction_outputs: str = _flag(
        "",
        "Directory for predictions.csv (one row per input record, in input order) when the "
        "model zoo has no PredictionOutputsProcessor.",
        commands=("predict",),
    )
    evaluation_steps: int = _flag(
        0, "Also evaluate every N model versions (0: at epoch ends only).", commands=("train",)
    )
    evaluation_start_delay_secs: float = _flag(
        0.0, "No --evaluation_steps evaluation before this many seconds of training.", commands=("train",)
    )
    evaluation_throttle_secs: float = _flag(
        0.0, "At least this many seconds between two --evaluation_steps evaluations.", commands=("train",)
    )
    data_reader_params: str = _flag(
        "", "Reader options, e.g. \"has_header=True\" for CSV files with a header line."
    )
    minibatch_size: int = _flag(64, "Records per minibatch.")
    num_epochs: int = _flag(1, "Passes over the training data.", commands=("train",))
    num_minibatches_per_task: int = _flag(
        8, "Minibatches per task, when --records_per_task is not given."
    )
    records_per_task: int = _flag(
        0, "Records per task (0: --minibatch_size x --num_minibatches_per_task)."
    )
    shuffle_seed: int = _flag(0, "Seed for the per-epoch task shuffle.", commands=("train",))

    # Roles.
    num_workers: int = _flag(1, "Number of workers.")
    num_ps: int = _flag(1, "Number of parameter servers.", aliases=("--num_ps_pods",))
    backend: str = _flag("local", "Where roles run: local (child processes) or kubernetes.")
    num_threads_per_process: int = _flag(
        0,
        "TensorFlow intra-op threads per worker (0: the machine's cores shared "
        "among the workers, at least 1).",
    )

    # Consistency.
    grads_to_wait: int = _flag(
        1,
        "Sync mode: gradients gathered (and averaged) per model version.",
        commands=("train",),
    )
    use_async: bool = _flag(
        False, "Apply each gradient as it arrives, without version checks.", commands=("train",)
    )
    staleness_bound: int = _flag(
        0,
        "Async only: stale-synchronous parallel; a worker waits while it is more than this "
        "many steps ahead of the slowest worker holding a task (0: no bound).",
        commands=("train",),
    )
    get_model_steps: int = _flag(
        1,
        "Async only: pull the model every N steps, applying the worker's own gradients "
        "locally in between.",
        commands=("train",),
    )
    sync_version_tolerance: int = _flag(
        0,
        "Sync only: accept gradients computed up to K versions behind the model.",
        commands=("train",),
    )
    lr_staleness_modulation: bool = _flag(
        False,
        "Divide each gradient's learning rate by its staleness (at least 1).",
        commands=("train",),
    )

    # Embedding tables.
    embedding_swap_threshold_mb: float = _flag(
        2.0,
        "keras.layers.Embedding layers whose table (input_dim x output_dim x 4 bytes) is larger "
        "than this many MiB become elasticdl.layers.Embedding: their rows live on the parameter "
        "servers, sharded by id (0: every Embedding; a negative value: none).",
    )

    # Elasticity.
    worker_pod_priority: str = _flag(
        "high",
        "Worker priority: high, low, or a fraction f (ceil(f*n) workers high, the rest low). "
        "Scaling down stops low-priority workers first.",
        commands=("train",),
    )
    relaunch_on_worker_failure: int = _flag(
        3,
        "Times a crashed worker is relaunched in its slot; one more crash ends the job with its "
        "error. Preempted or killed workers are replaced without counting.",
        commands=("train",),
    )

    etcd_endpoints: str = _flag(
        "",
        "etcd (v3) endpoints host:port[,host:port]: the master keeps the task ledger there under "
        "/elasticdl/<job_name>/ and a restarted master resumes the job (empty: in memory).",
        commands=("train",),
    )

    # Fault handling.
    task_timeout: float = _flag(
        600.0, "Seconds a task may stay in progress before it goes back to the queue."
    )
    max_task_retries: int = _flag(
        3, "Times a task may fail or time out before it is dropped and reported."
    )

    # Checkpoints and output.
    checkpoint_dir: str = _flag("", "Directory for PS checkpoints (empty: no checkpoints).")
    checkpoint_steps: int = _flag(
        0, "Checkpoint every N model versions (0: only at the end of training)."
    )
    keep_checkpoint_max: int = _flag(3, "Checkpoints to keep (0: keep all).")
    checkpoint_dir_for_init: str = _flag(
        "", "A checkpoint (a version-N directory, or a checkpoint dir: its latest) to start from."
    )
    output: str = _flag("", "Directory for the exported SavedModel.", commands=("train",))
    tensorboard_log_dir: str = _flag(
        "",
        "Write TensorBoard scalars here (loss, eval metrics, examples/s, live workers).",
        commands=("train", "evaluate"),
    )

    # Kubernetes (--backend kubernetes; see docs/kubernetes.md).
    image_name: str = _flag("", "Kubernetes: the Docker image every pod runs (build it with `elasticdl zoo build`).")
    namespace: str = _flag("default", "Kubernetes: the namespace of the job's pods.")
    image_pull_policy: str = _flag("Always", "Kubernetes: Always, IfNotPresent or Never.")
    master_resource_request: str = _flag(
        "cpu=0.1,memory=1024Mi", "Kubernetes: the master pod's requests, like cpu=1,memory=4096Mi,gpu=1."
    )
    master_resource_limit: str = _flag("", "Kubernetes: the master pod's limits (empty: its requests).")
    worker_resource_request: str = _flag(
        "cpu=1,memory=4096Mi", "Kubernetes: each worker pod's requests (gpu=N asks for nvidia.com/gpu)."
    )
    worker_resource_limit: str = _flag("", "Kubernetes: each worker pod's limits (empty: its requests).")
    ps_resource_request: str = _flag("cpu=1,memory=4096Mi", "Kubernetes: each PS pod's requests.")
    ps_resource_limit: str = _flag("", "Kubernetes: each PS pod's limits (empty: its requests).")
    master_pod_priority: str = _flag(
        "", "Kubernetes: the master pod's PriorityClass (high, low or a class name; empty: the default)."
    )
    ps_pod_priority: str = _flag(
        "", "Kubernetes: the PS pods' PriorityClass (high, low or a class name; empty: the default)."
    )
    volume: str = _flag(
        "",
        "Kubernetes: volumes for every pod: claim_name=c,mount_path=/data or "
        "host_path=/x,mount_path=/data, several separated by ';'.",
    )
    envs: str = _flag("", "Kubernetes: extra environment for every pod: NAME=value,NAME2=value2.")
    cluster_spec: str = _flag(
        "",
        "Kubernetes: a Python file defining with_pod(pod) and/or with_service(service), called "
        "on every manifest (dicts) before it is created.",
    )
    yaml: str = _flag("", "Kubernetes: write the master's manifests to this file instead of submitting them.")
    detach: bool = _flag(
        False, "Kubernetes: return once the master pod is submitted instead of following it to the end."
    )

    # Job.
    job_name: str = _flag("", "Job name (default: elasticdl-<model>-<time>).")
    log_level: str = _flag("INFO", "DEBUG, INFO, WARNING or ERROR.")
    log_dir: str = _flag("", "Where role logs go (default: runs/<job_name>/logs).")

    # ---------------------------------------------------------------- helpers

    @property
    def effective_records_per_task(self) -> int:
        return self.records_per_task or self.minibatch_size * self.num_minibatches_per_task

    @property
    def model_params_dict(self) -> dict[str, Any]:
        return parse_kv_params(self.model_params, "--model_params")

    @property
    def data_reader_params_dict(self) -> dict[str, Any]:
        return parse_kv_params(self.data_reader_params, "--data_reader_params")

    @property
    def run_dir(self) -> str:
        return os.path.join("runs", self.job_name)

    @property
    def effective_log_dir(self) -> str:
        return self.log_dir or os.path.join(self.run_dir, "logs")

    def with_defaults(self) -> JobConfig:
        """Fill the defaults that depend on other fields."""
        cfg = dataclasses.replace(self)
        cfg.log_level = cfg.log_level.upper()
        if not cfg.job_name:
            model = cfg.model_def.rsplit(".", 2)[0].replace(".", "-").replace("_", "-") or "job"
            cfg.job_name = f"elasticdl-{model}-{time.strftime('%Y%m%d-%H%M%S')}"
        if not cfg.prediction_outputs:
            cfg.prediction_outputs = os.path.join(cfg.run_dir, "predictions")
        return cfg

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        return cls(**json.loads(text))

    def validate(self, command: str = "train", check_paths: bool = True) -> None:
        """Raise ConfigError for flags that cannot work, before anything starts.

        ``check_paths=False``: a Kubernetes client, where paths name files in the pods.
        """
        if command not in COMMANDS:
            raise ConfigError(f"Unknown command {command!r}; use one of {', '.join(COMMANDS)}.")
        if not self.model_zoo:
            raise ConfigError("--model_zoo is required: the directory holding your model-zoo packages.")
        if check_paths and not os.path.isdir(self.model_zoo):
            raise ConfigError(f"--model_zoo {self.model_zoo!r} is not a directory.")
        if not self.model_def or "." not in self.model_def:
            raise ConfigError(
                f"--model_def must be pkg.module.name under --model_zoo "
                f"(e.g. digits.digits_functional.custom_model). Received: {self.model_def!r}"
            )
        if command == "train" and not self.training_data:
            raise ConfigError("--training_data is required for `elasticdl train`.")
        if command == "evaluate" and not self.validation_data:
            raise ConfigError("--validation_data is required for `elasticdl evaluate`.")
        if command == "predict" and not self.prediction_data:
            raise ConfigError("--prediction_data is required for `elasticdl predict`.")
        if command in ("evaluate", "predict") and not self.checkpoint_dir_for_init:
            raise ConfigError(
                f"--checkpoint_dir_for_init is required for `elasticdl {command}`: the model to "
                f"{command} (a checkpoint written by `elasticdl train --checkpoint_dir`)."
            )
        for name in ("evaluation_steps", "evaluation_start_delay_secs", "evaluation_throttle_secs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be 0 or more. Received: {name}={getattr(self, name)}")
        if self.evaluation_steps and not self.validation_data:
            raise ConfigError("--evaluation_steps needs --validation_data: what should be evaluated?")
        for name in ("minibatch_size", "num_epochs", "num_workers", "num_ps", "grads_to_wait",
                     "num_minibatches_per_task"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"--{name} must be at least 1. Received: {name}={value}")
        for name in ("records_per_task", "checkpoint_steps", "keep_checkpoint_max",
                     "max_task_retries", "num_threads_per_process", "relaunch_on_worker_failure"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"--{name} must be 0 or more. Received: {name}={value}")
        if self.task_timeout <= 0:
            raise ConfigError(f"--task_timeout must be positive. Received: {self.task_timeout}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}. Received: {self.backend!r}")
        if self.backend == "kubernetes":
            from elasticdl.config.kubernetes import OptionError, validate_kubernetes_flags

            try:
                validate_kubernetes_flags(self)
            except OptionError as err:
                raise ConfigError(str(err)) from None
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log_level must be one of {', '.join(LOG_LEVELS)}. Received: {self.log_level!r}")
        self._validate_consistency()
        from elasticdl.config.priority import parse_priority_spec

        try:
            parse_priority_spec(self.worker_pod_priority)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.checkpoint_steps and not self.checkpoint_dir:
            raise ConfigError("--checkpoint_steps needs --checkpoint_dir: where should checkpoints go?")
        if check_paths and self.checkpoint_dir_for_init and not os.path.exists(self.checkpoint_dir_for_init):
            raise ConfigError(f"--checkpoint_dir_for_init {self.checkpoint_dir_for_init!r} does not exist.")
        if check_paths:
            self._validate_checkpoint_dir(command)
        # Parse now so a malformed string fails here, not in a worker.
        self.model_params_dict  # noqa: B018
        self.data_reader_params_dict  # noqa: B018

    def _validate_checkpoint_dir(self, command: str) -> None:
        """A fresh job must not mix its versions with an old job's: they would collide and be pruned."""
        if command != "train" or not self.checkpoint_dir or not os.path.isdir(self.checkpoint_dir):
            return
        old = [e for e in os.listdir(self.checkpoint_dir) if e.startswith("version-")]
        same_dir = self.checkpoint_dir_for_init and os.path.abspath(self.checkpoint_dir_for_init).startswith(
            os.path.abspath(self.checkpoint_dir)
        )
        if old and not same_dir and not self.etcd_endpoints:  # with etcd, a restarted master resumes
            raise ConfigError(
                f"--checkpoint_dir {self.checkpoint_dir!r} already holds checkpoints ({len(old)} versions). "
                f"Pass --checkpoint_dir_for_init {self.checkpoint_dir} to continue from the latest, "
                "or choose an empty directory."
            )

    def _validate_consistency(self) -> None:
        for name in ("staleness_bound", "sync_version_tolerance"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be 0 or more. Received: {name}={getattr(self, name)}")
        if self.get_model_steps < 1:
            raise ConfigError(f"--get_model_steps must be at least 1. Received: {self.get_model_steps}")
        if self.use_async:
            conflicts = [
                f"--grads_to_wait={self.grads_to_wait}" if self.grads_to_wait != 1 else "",
                f"--sync_version_tolerance={self.sync_version_tolerance}" if self.sync_version_tolerance else "",
            ]
            conflicts = [c for c in conflicts if c]
            if conflicts:
                raise ConfigError(
                    f"{' and '.join(conflicts)} only apply to sync training, but --use_async is set: "
                    "drop them or drop --use_async."
                )
            return
        conflicts = [
            f"--staleness_bound={self.staleness_bound}" if self.staleness_bound else "",
            f"--get_model_steps={self.get_model_steps}" if self.get_model_steps != 1 else "",
        ]
        conflicts = [c for c in conflicts if c]
        if conflicts:
            raise ConfigError(
                f"{' and '.join(conflicts)} only apply to async training: add --use_async "
                "(stale-synchronous parallel is --use_async with --staleness_bound)."
            )
        if self.lr_staleness_modulation and not self.sync_version_tolerance:
            raise ConfigError(
                "--lr_staleness_modulation has no effect in strict sync training (every applied "
                "gradient has staleness 0): add --use_async or --sync_version_tolerance."
            )

    @property
    def consistency_description(self) -> str:
        if not self.use_async:
            tolerance = f", version tolerance {self.sync_version_tolerance}" if self.sync_version_tolerance else ""
            return f"sync SGD, grads_to_wait={self.grads_to_wait}{tolerance}"
        if self.staleness_bound:
            return f"stale-synchronous parallel, staleness bound {self.staleness_bound}"
        return "async SGD" + (f", pull every {self.get_model_steps} steps" if self.get_model_steps > 1 else "")

    @property
    def logging_level(self) -> int:
        return getattr(logging, self.log_level.upper())


def parse_kv_params(text: str, flag: str) -> dict[str, Any]:
    """Parse ``"a=1;b=2.5;c='x';d=True"`` into keyword arguments (Python literals, else strings)."""
    import ast

    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(
                f"{flag} must look like \"a=1;b=2.5;c='x'\". Cannot parse {item!r} in {text!r}."
            )
        raw = raw.strip()
        try:
            params[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError):  # TypeError: e.g. {[]: 1}, an unhashable key
            params[key] = raw  # a bare word such as relu
    return params
