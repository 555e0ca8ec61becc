"""The job's configuration in sections: one dataclass per concern, each field one flag.

A field's ``metadata`` carries its command-line help, the commands that take it, its aliases
and a number's range (elasticdl/config/fields.py). A *structured* flag (``"a=1;b=2"``,
``"cpu=1,memory=4096Mi"``, ``"high"`` ...) is typed as text on the command line and held as
the value its text means (a dict, a list of Volume, a fraction ...); its metadata also carries
how to parse the text and how to write the value back as text (elasticdl/config/structured.py).
``JobConfig`` (elasticdl/config/job_config.py) holds one instance of every section and is the
only place that turns flat flags into sections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from elasticdl.config.class_weight import parse_class_weight, render_class_weight
from elasticdl.config.errors import ConfigError
from elasticdl.config.fields import AT_LEAST_1, Bounds, flag, structured
from elasticdl.config.kubernetes import Volume, parse_envs, parse_resources, parse_volumes
from elasticdl.config.structured import (
    kv_params,
    option,
    parse_endpoints,
    parse_priority,
    render_kv_params,
    render_pairs,
    render_priority,
    render_volumes,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# --wire_dtype's values: what dense float32 tensors travel as (elasticdl/rpc/codec.py).
WIRE_DTYPES = ("float32", "bfloat16", "float16")
# --tensor_transport's values: how dense tensor bytes travel (elasticdl/rpc/bulk.py).
TENSOR_TRANSPORTS = ("grpc", "tcp")
# A count of which 0 means nothing (a batch, an epoch, a worker): at least 1.


@dataclass
class TrainingSection:
    """The model and how it is trained."""

    TITLE: ClassVar[str] = "Model and training"

    model_zoo: str = flag("", "Directory that holds the model-zoo packages (required).")
    model_def: str = flag(
        "",
        "The model function or class, as pkg.module.name under --model_zoo "
        "(e.g. digits.digits_functional.custom_model; required).",
    )
    model_params: dict[str, Any] = structured(
        "", "Keyword arguments for the model function: \"a=1;b=2.5;c='x'\".",
        kv_params("--model_params"), render_kv_params,
    )
    minibatch_size: int = flag(64, "Records per minibatch.", bounds=AT_LEAST_1)
    class_weight: dict[int, float] = structured(
        "", "Keras's fit(class_weight=...): each training example weighs its class's weight in the "
        "loss, '0:1.0,1:5.0' or JSON '{\"0\": 1.0, \"1\": 5.0}' (a class not named weighs 1); "
        "overrides the module's class_weight(). docs/model_zoo.md, Sample and class weights.",
        parse_class_weight, render_class_weight, commands=("train",),
    )
    num_epochs: int = flag(1, "Passes over the training data.", commands=("train",), bounds=AT_LEAST_1)
    num_threads_per_process: int = flag(
        0,
        "TensorFlow intra-op threads per worker (0: the machine's cores shared "
        "among the workers, at least 1).",
    )
    embedding_swap_threshold_mb: float = flag(
        2.0,
        "keras.layers.Embedding layers whose table (input_dim x output_dim x 4 bytes) is larger "
        "than this many MiB become elasticdl.layers.Embedding: their rows live on the parameter "
        "servers, sharded by id (0: every Embedding; a negative value: none).",
        bounds=Bounds(low=None),
    )
    slice_dense_above_mb: float = flag(
        32.0,
        "Dense variables larger than this many MiB (with at least one row per parameter server) are "
        "cut by rows into one slice per parameter server, each held and updated by its own; smaller "
        "ones stay whole, placed by a hash of their name (0: every variable with enough rows; a "
        "negative value: none). docs/embeddings.md, Sliced dense variables.",
        bounds=Bounds(low=None),
    )
    embedding_admit_min_count: int = flag(
        1,
        "Tables the automatic swap makes (--embedding_swap_threshold_mb): an id gets a row at its "
        "Nth sighting; until then it reads the zero row and its gradient is dropped (1: at once). "
        "docs/embeddings.md, Bounded tables.",
        bounds=Bounds(low=1, high=65535),
    )
    embedding_ttl_versions: int = flag(
        0,
        "Tables the automatic swap makes: a row not updated for this many model versions is "
        "removed from its parameter server (0: never).",
        bounds=Bounds(low=0),
    )
    embedding_max_rows: int = flag(
        0,
        "Tables the automatic swap makes: at most this many rows per table on each parameter "
        "server; the least recently updated rows are removed first (0: no cap).",
        bounds=Bounds(low=0),
    )
    wire_dtype: str = flag(
        "float32",
        "What dense gradients and parameters travel as between workers and parameter servers: "
        "float32, bfloat16 or float16 (half the bytes; the servers keep float32 and the workers "
        "compute in float32; embedding rows stay float32). docs/benchmarks.md measures its effect on "
        "accuracy and speed.",
        commands=("train",),
    )
    tensor_transport: str = flag(
        "grpc",
        "How a large dense pull or push (a PS's part of the model above 4 MB) travels: grpc, "
        "or tcp: raw frames on a socket each PS opens beside its gRPC server (a free port on the "
        "PS's own address, its pod's IP on Kubernetes; the job's token), without the copies gRPC "
        "makes of each message. A call that cannot use the socket goes over gRPC (a port that "
        "cannot be reached is tried again after 30 s); a push whose answer the socket lost is "
        "sent again over gRPC, and the PS applies it once. Experimental.",
        commands=("train",),
    )


@dataclass
class DataSection:
    """What the job reads, and how it is cut into tasks."""

    TITLE: ClassVar[str] = "Data and tasks"

    training_data: str = flag(
        "",
        "Training data: a file, a directory, a glob, or several separated by commas "
        "(TFRecord or RecordIO of tf.train.Example, or .csv/.txt lines).",
        commands=("train",),
    )
    validation_data: str = flag(
        "",
        "Validation data (same forms as --training_data), evaluated with eval_metrics_fn() "
        "at each epoch's end, every --evaluation_steps versions, and when training ends.",
        commands=("train", "evaluate"),
    )
    prediction_data: str = flag(
        "", "Data to predict on (same forms as --training_data).", commands=("predict",)
    )
    data_reader_params: dict[str, Any] = structured(
        "", "Reader options: \"has_header=True\" for CSV files with a header line; \"columns=a,b,c\" to "
        "read only these columns of Parquet files; \"records=columns\" to give dataset_fn a dict of column "
        "tensors per Parquet row instead of a serialized tf.train.Example (records=examples, the default).",
        kv_params("--data_reader_params"), render_kv_params,
    )
    num_minibatches_per_task: int = flag(
        8, "Minibatches per task, when --records_per_task is not given.",
        bounds=AT_LEAST_1,
    )
    records_per_task: int = flag(
        0, "Records per task (0: --minibatch_size x --num_minibatches_per_task)."
    )
    shuffle_seed: int = flag(0, "Seed for the per-epoch task shuffle.", commands=("train",))
    shuffle_tasks: bool = flag(
        True,
        "Shuffle the order of the training tasks every epoch (as model.fit's shuffle). false: tasks go "
        "out in the data's order (files sorted by name, records in file order), e.g. to replay a "
        "time-ordered log as it happened.",
        commands=("train",),
    )
    max_bad_records: int = flag(
        0,
        "Skip up to this many bad records in the job (corrupt, unparseable, or rejected by the model "
        "or loss, e.g. a label out of range); the report lists each with its file, index and reason. "
        "One more fails the job. 0: the first bad record fails the job.",
        commands=("train", "evaluate"),
    )

    @property
    def has_header(self) -> bool:
        return bool(self.data_reader_params.get("has_header", False))

    @property
    def records(self) -> str:
        """How a Parquet row reaches dataset_fn: "examples" (a serialized tf.train.Example, the
        default) or "columns" (a dict of column tensors), from ``records=`` of --data_reader_params."""
        value = str(self.data_reader_params.get("records") or "examples").strip().lower()
        if value not in ("examples", "columns"):
            raise ConfigError(
                f"--data_reader_params records={self.data_reader_params.get('records')!r}: use records=examples "
                "(a serialized tf.train.Example per Parquet row, the default) or records=columns (a dict of "
                "column tensors per row)"
            )
        return value

    @property
    def columns(self) -> list[str] | None:
        """The Parquet columns to read (``columns=a,b,c``); None reads them all."""
        value = self.data_reader_params.get("columns")
        if not value:
            return None
        names = value.split(",") if isinstance(value, str) else list(value)
        return [str(n).strip() for n in names if str(n).strip()]


@dataclass
class EvaluationSection:
    """When evaluation rounds run during training (besides each epoch's end)."""

    TITLE: ClassVar[str] = "Evaluation"

    evaluation_steps: int = flag(
        0, "Also evaluate every N model versions (0: at epoch ends only).", commands=("train",)
    )
    evaluation_start_delay_secs: float = flag(
        0.0, "No --evaluation_steps evaluation before this many seconds of training.", commands=("train",)
    )
    evaluation_throttle_secs: float = flag(
        0.0, "At least this many seconds between two --evaluation_steps evaluations.", commands=("train",)
    )


@dataclass
class ElasticitySection:
    """How many roles run, how workers are preempted and relaunched, how tasks are retried."""

    TITLE: ClassVar[str] = "Elasticity and fault handling"

    num_workers: int = flag(1, "Number of workers.", bounds=AT_LEAST_1)
    max_workers: int = flag(
        64,
        "Most workers the job may ever have: --num_workers and `elasticdl scale --num_workers` "
        "may not ask for more (fixed when the job starts).",
        bounds=AT_LEAST_1,
    )
    num_ps: int = flag(1, "Number of parameter servers.", aliases=("--num_ps_pods",), bounds=AT_LEAST_1)
    ps_replicas: int = flag(
        0,
        "Backups of each PS shard, kept up to date on the next PS (0-2, below --num_ps): a PS death "
        "promotes a backup instead of rolling back to a checkpoint (docs/replicas.md).",
        bounds=Bounds(low=0, high=2), commands=("train",),
    )
    worker_pod_priority: float = structured(
        "high",
        "Worker priority: high, low, or a fraction f (ceil(f*n) workers high, the rest low). "
        "Scaling down stops low-priority workers first.",
        parse_priority, render_priority,
        commands=("train",),
    )
    relaunch_on_worker_failure: int = flag(
        3,
        "Times a crashed worker is relaunched in its slot; one more crash ends the job with its "
        "error. Preempted or killed workers are replaced without counting.",
        commands=("train",),
    )
    task_timeout: float = flag(
        600.0, "Seconds a task may stay in progress before it goes back to the queue.",
        bounds=Bounds(low=0, low_open=True),
    )
    max_task_retries: int = flag(
        3, "Times a task may fail or time out before it is dropped and reported."
    )
    etcd_endpoints: list[str] = structured(
        "",
        "etcd (v3) endpoints host:port[,host:port]: the master keeps the task ledger there under "
        "/elasticdl/<job_name>/ and a restarted master resumes the job (empty: in memory).",
        parse_endpoints, ",".join,
        commands=("train",),
    )

    def replicas_problem(self) -> str:
        """Why --ps_replicas cannot work with --num_ps ('' when it can): checked at submit."""
        if self.ps_replicas >= self.num_ps > 0 and self.ps_replicas:
            return (
                f"--ps_replicas {self.ps_replicas} needs more parameter servers than replicas (each shard's "
                f"backups run on other PS): give --num_ps {self.ps_replicas + 1} or more, or a smaller "
                f"--ps_replicas. Received: --num_ps {self.num_ps}"
            )
        return ""

    def workers_problem(self, num_workers: int) -> str:
        """Why the job may not have ``num_workers`` workers ('' when it may): at submit time
        and for each `elasticdl scale`."""
        if num_workers > self.max_workers:
            return (
                f"--num_workers {num_workers} is more than --max_workers {self.max_workers}: ask for at "
                f"most {self.max_workers} workers, or start the job with a larger --max_workers "
                "(it cannot change while the job runs)."
            )
        return ""


@dataclass
class CheckpointSection:
    """Where the parameter servers write checkpoints, and which one a job starts from."""

    TITLE: ClassVar[str] = "Checkpoints"

    checkpoint_dir: str = flag("", "Directory for PS checkpoints (empty: no checkpoints).")
    checkpoint_steps: int = flag(
        0, "Checkpoint every N model versions (0: only at the end of training)."
    )
    keep_checkpoint_max: int = flag(3, "Checkpoints to keep (0: keep all).")
    checkpoint_dir_for_init: str = flag(
        "", "A checkpoint (a version-N directory, or a checkpoint dir: its latest) to start from."
    )


@dataclass
class OutputSection:
    """What a job leaves behind besides checkpoints and logs."""

    TITLE: ClassVar[str] = "Outputs"

    output: str = flag("", "Directory for the exported SavedModel.", commands=("train",))
    prediction_outputs: str = flag(
        "",
        "Directory for predictions.csv (one row per input record, in input order) when the "
        "model zoo has no PredictionOutputsProcessor.",
        commands=("predict",),
    )
    tensorboard_log_dir: str = flag(
        "",
        "Write TensorBoard scalars here (loss, eval metrics, examples/s, live workers).",
        commands=("train", "evaluate"),
    )


@dataclass
class JobSection:
    """The job's name, where its roles run, and its logs."""

    TITLE: ClassVar[str] = "Job and logging"

    job_name: str = flag("", "Job name (default: elasticdl-<model>-<time>).")
    backend: str = flag("local", "Where roles run: local (child processes) or kubernetes.")
    log_level: str = flag("INFO", "DEBUG, INFO, WARNING or ERROR.")
    log_dir: str = flag("", "Where role logs go (default: runs/<job_name>/logs).")

    @property
    def run_dir(self) -> str:
        return os.path.join("runs", self.job_name)

    @property
    def effective_log_dir(self) -> str:
        return self.log_dir or os.path.join(self.run_dir, "logs")

    @property
    def logging_level(self) -> int:
        import logging

        return getattr(logging, self.log_level.upper())


@dataclass
class KubernetesSection:
    """The pods of --backend kubernetes (see docs/kubernetes.md)."""

    TITLE: ClassVar[str] = "Kubernetes"

    image_name: str = flag("", "Kubernetes: the Docker image every pod runs (build it with `elasticdl zoo build`).")
    namespace: str = flag("default", "Kubernetes: the namespace of the job's pods.")
    image_pull_policy: str = flag("Always", "Kubernetes: Always, IfNotPresent or Never.")
    master_resource_request: dict[str, str] = structured(
        "cpu=0.1,memory=1024Mi", "Kubernetes: the master pod's requests, like cpu=1,memory=4096Mi,gpu=1.",
        option(parse_resources, "--master_resource_request"), render_pairs,
    )
    master_resource_limit: dict[str, str] = structured(
        "", "Kubernetes: the master pod's limits (empty: its requests).",
        option(parse_resources, "--master_resource_limit"), render_pairs,
    )
    worker_resource_request: dict[str, str] = structured(
        "cpu=1,memory=4096Mi", "Kubernetes: each worker pod's requests (gpu=N asks for nvidia.com/gpu).",
        option(parse_resources, "--worker_resource_request"), render_pairs,
    )
    worker_resource_limit: dict[str, str] = structured(
        "", "Kubernetes: each worker pod's limits (empty: its requests).",
        option(parse_resources, "--worker_resource_limit"), render_pairs,
    )
    ps_resource_request: dict[str, str] = structured(
        "cpu=1,memory=4096Mi", "Kubernetes: each PS pod's requests.",
        option(parse_resources, "--ps_resource_request"), render_pairs,
    )
    ps_resource_limit: dict[str, str] = structured(
        "", "Kubernetes: each PS pod's limits (empty: its requests).",
        option(parse_resources, "--ps_resource_limit"), render_pairs,
    )
    master_pod_priority: str = flag(
        "", "Kubernetes: the master pod's PriorityClass (high, low or a class name; empty: the default)."
    )
    ps_pod_priority: str = flag(
        "", "Kubernetes: the PS pods' PriorityClass (high, low or a class name; empty: the default)."
    )
    volume: list[Volume] = structured(
        "",
        "Kubernetes: volumes for every pod: claim_name=c,mount_path=/data or "
        "host_path=/x,mount_path=/data, several separated by ';'.",
        option(parse_volumes, "--volume"), render_volumes,
    )
    envs: dict[str, str] = structured(
        "", "Kubernetes: extra environment for every pod: NAME=value,NAME2=value2. "
        "Every value counts as a secret: it is kept in the job's Secret.",
        option(parse_envs, "--envs"), render_pairs,
    )
    cluster_spec: str = flag(
        "",
        "Kubernetes: a Python file defining with_pod(pod) and/or with_service(service), called "
        "on every manifest (dicts) before it is created.",
    )
    yaml: str = flag("", "Kubernetes: write the master's manifests to this file instead of submitting them.")
    detach: bool = flag(
        False, "Kubernetes: return once the master pod is submitted instead of following it to the end."
    )

    def resources(self, role: str) -> tuple[dict[str, str], dict[str, str]]:
        """(requests, limits) of a role's pods: master, worker or ps; no limits given: the requests."""
        requests = getattr(self, f"{role}_resource_request")
        return dict(requests), dict(getattr(self, f"{role}_resource_limit") or requests)


@dataclass
class ModelZooSection:
    """Which functions of the model-zoo module to use, and the Keras it is written for
    (the original ElasticDL's flags; see docs/model_zoo.md#migrating-from-the-original-elasticdl)."""

    TITLE: ClassVar[str] = "Model-zoo functions and Keras"

    keras_version: str = flag(
        "auto",
        "The Keras the module is written for: 2 (tf_keras: tf.keras, feature columns, DenseFeatures; "
        "needs tf-keras: make keras2, see README.md), 3, or auto (read from the module's source at submit time).",
    )
    feed: str = flag("", "The dataset function's name in the module (empty: dataset_fn, else feed).")
    loss: str = flag("loss", "The loss function's name in the module.")
    optimizer: str = flag("optimizer", "The optimizer function's name in the module.")
    eval_metrics_fn: str = flag("eval_metrics_fn", "The metrics function's name in the module (optional).")
    callbacks: str = flag("callbacks", "The callbacks function's name in the module (optional).")
    custom_data_reader: str = flag(
        "custom_data_reader",
        "The original ElasticDL's custom data reader's name: a module that defines it is refused "
        "with the alternative (readers here are chosen by file format).",
    )
    prediction_outputs_processor: str = flag(
        "PredictionOutputsProcessor",
        "The prediction outputs processor class's name in the module (optional).",
        commands=("predict",),
    )

    def names(self) -> dict[str, str]:
        """Contract name -> the name to look up in the module."""
        return {
            "dataset_fn": self.feed, "loss": self.loss, "optimizer": self.optimizer,
            "eval_metrics_fn": self.eval_metrics_fn, "callbacks": self.callbacks,
            "custom_data_reader": self.custom_data_reader,
            "PredictionOutputsProcessor": self.prediction_outputs_processor,
        }
