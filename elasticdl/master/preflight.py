"""Submit-time checks: everything that can be wrong is found before any process starts.

Loads the model zoo, counts the data, and runs one real batch through ``dataset_fn``,
the model, ``loss`` and a gradient, so a broken model-zoo file fails here with a
message naming the function and the fix, not minutes later in a worker's log.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

from elasticdl.config import JobConfig
from elasticdl.config.paths import MIN_FREE_BYTES, check_writable_dir
from elasticdl.data.columns import select
from elasticdl.data.errors import BadRecord, BadRecordError, CorruptRecordError, DataError, NoDataFilesError
from elasticdl.data.kafka_address import is_kafka
from elasticdl.data.kafka_checks import check_stream, sample_stream
from elasticdl.data.sources import (
    check_parquet_schemas,
    count_records,
    read_columns,
    read_records,
    record_format,
    resolve_data_files,
)
from elasticdl.mode import Mode
from elasticdl.model.checkpoint import resolve_checkpoint
from elasticdl.model.checkpoint_owner import check_owner, continues
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.model.optimizers import (
    OptimizerSpec,
    UnsupportedOptimizerError,
    make_optimizer,
    optimizer_spec_from_keras,
)
from elasticdl.model.records import describe_error
from elasticdl.model.sample_weight import features_of, unpack, weighted_loss
from elasticdl.model.slicing import DenseSlicing, clipnorm_problem
from elasticdl.model.spec import DatasetMetadata, ModelSpec, ModelSpecError, load_model_spec, model_def_path
from elasticdl.model.step_overrides import check_hooks

logger = logging.getLogger(__name__)


@dataclass
class CheckedJob:
    config: JobConfig
    spec: ModelSpec
    optimizer_spec: OptimizerSpec
    files: list[tuple[str, int]]  # (path, records) of the data the command reads
    sample_features: Any  # one batch of features: builds the model for export


def check_inputs(config: JobConfig, command: str = "train") -> list[tuple[str, int]]:
    """The checks that need no TensorFlow: the flags, the model-zoo file, the data files and
    their records; (path, records) of the data the command reads. A typo fails in a fraction
    of a second, not after TensorFlow's import (seconds)."""
    return _check_inputs(config, command)[0]


def _check_inputs(config: JobConfig, command: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """check_inputs, and (path, records) of --validation_data when `train` evaluates it."""
    config.validate(command)
    model_def_path(config.training.model_zoo, config.training.model_def)
    flag = {"train": "--training_data", "evaluate": "--validation_data", "predict": "--prediction_data"}[command]
    if is_kafka(config.flag_value(flag[2:])):
        files = check_stream(flag, config.flag_value(flag[2:]), command)
    else:
        files = count_data(flag, config.flag_value(flag[2:]), config.data.has_header)
    validation = []
    if config.data.validation_data and command == "train":
        # Checked as the training data is, now: evaluation reads it only after an epoch.
        validation = count_data("--validation_data", config.data.validation_data, config.data.has_header,
                                optional=True)
    files_read = [path for path, _ in files + validation]
    check_parquet_schemas(files_read, config.data.columns)
    if config.data.records == "columns":
        other = [path for path in files_read if record_format(path) != "parquet"]
        if other:
            raise DataError(
                f"{other[0]}: --data_reader_params records=columns reads Parquet files (.parquet, .pq), and this "
                f"is {record_format(other[0])}: drop records=columns, or convert the data to Parquet"
            )
    return files, validation


def count_data(flag: str, spec: str, has_header: bool, optional: bool = False) -> list[tuple[str, int]]:
    """(path, records) of every file ``spec`` names, each counted from its framing; a DataError
    naming ``flag`` when a file cannot be read or is in no format the readers know, and when the
    files hold no record at all. The same rules for every flag that names data (``optional``:
    the command runs without it too)."""
    if is_kafka(spec):
        raise DataError(f"{flag}: {spec} is a Kafka stream, and {flag} reads files: a stream is --training_data")
    try:
        paths = resolve_data_files(spec)
    except NoDataFilesError as err:
        raise NoDataFilesError(f"{flag}: {err}") from None
    files = []
    for path in paths:
        try:
            files.append((path, count_records(path, has_header)))
        except CorruptRecordError as err:
            raise DataError(
                f"{flag}: {path} cannot be read as {record_format(path)} (record {err.index} at byte "
                f"{err.offset}: {err.problem}): it is truncated, corrupt or in another format. Regenerate "
                f"it, or remove it from {flag}."
            ) from None
        except DataError as err:
            raise DataError(f"{flag}: {err}") from None
        except OSError as err:
            raise DataError(
                f"{flag}: cannot read {path}: {err.strerror or err}. Make it readable by this user, "
                f"or remove it from {flag}."
            ) from None
    if sum(n for _, n in files) == 0:
        header = " (a CSV header line is no record)" if has_header else ""
        raise DataError(
            f"{flag} {spec!r} holds no records: {len(files)} file{'s' if len(files) > 1 else ''}, "
            f"all empty{header}. Name data with at least one record"
            + (f", or drop {flag}." if optional else ".")
        )
    return files


def check_job(config: JobConfig, command: str = "train", before_tensorflow=None) -> CheckedJob:
    """Every submit-time check. ``before_tensorflow`` runs once the checks that need no
    TensorFlow passed, before the model zoo is imported (the CLI sets TensorFlow up there)."""
    if command == "train" and config.checkpoints.checkpoint_dir:  # before any process starts
        directory = config.checkpoints.checkpoint_dir
        check_owner(directory, config.job.job_name, continues(directory, config.checkpoints.checkpoint_dir_for_init))
    files, validation = _check_inputs(config, command)
    if before_tensorflow is not None:
        before_tensorflow()
    spec = load_model_spec(config.training.model_zoo, config.training.model_def,
                           config.model_zoo_functions.names(), config.training.class_weight)
    optimizer_spec = _check_optimizer(spec)
    metrics = check_eval_metrics(spec)
    has_header = config.data.has_header
    if command == "evaluate" and not metrics:
        raise ModelSpecError(
            f"{spec.module_path}: `elasticdl evaluate` needs eval_metrics_fn() -> {{name: metric}}."
        )
    if config.data.validation_data and command == "train":
        if not metrics:
            logger.warning(
                "--validation_data is set but %s defines no eval_metrics_fn(): no metrics will be "
                "computed. Define eval_metrics_fn() -> {name: metric}.", spec.module_path,
            )
    if command == "train":
        _check_callbacks(spec)
    if config.outputs.tensorboard_log_dir:
        try:
            import tensorboard  # noqa: F401  (tf.summary needs it; TensorFlow does not bring it)
        except ImportError:
            raise ModelSpecError("--tensorboard_log_dir needs the tensorboard package: pip install tensorboard") from None
    mode = {"train": Mode.TRAINING, "evaluate": Mode.EVALUATION, "predict": Mode.PREDICTION}[command]
    features, trainer = _check_one_batch(spec, config, files, has_header, metrics, mode)
    for skipped in [command] + (["evaluate"] if command == "train" and validation and metrics else []):
        check_hooks(trainer.model, skipped, spec.module_path, spec.model_name)  # a train_step is never run
    if command == "train":
        _check_room_for_the_model(config, optimizer_spec, trainer)
        problem = clipnorm_problem(DenseSlicing.from_flag(config.training.slice_dense_above_mb, config.elasticity.num_ps),
                                   optimizer_spec.config, trainer.variables)
        if problem:
            raise ModelSpecError(f"{spec.module_path}: {problem}")
    if validation and metrics:
        # A first batch of --validation_data through dataset_fn, the model and the metrics, as
        # the evaluation reads it (after an epoch of training): other features fail now.
        _check_one_batch(spec, config, validation, has_header, metrics, Mode.EVALUATION)
    if config.checkpoints.checkpoint_dir_for_init:  # damaged or incomplete: exit 2 now, not a PS's death later
        resolve_checkpoint(config.checkpoints.checkpoint_dir_for_init)
    return CheckedJob(config, spec, optimizer_spec, files, features)


def _check_room_for_the_model(config: JobConfig, optimizer_spec: OptimizerSpec, trainer) -> None:
    """--checkpoint_dir has room for one checkpoint of the dense model (its variables, the
    optimizer's slots for the trainable ones), --output for the SavedModel: a full disk fails now,
    not after training. (config.validate checked that both are writable directories, or creatable.)"""
    parameter_bytes = sum(int(v.numpy().nbytes) for v in trainer.variables.values())
    state_bytes = sum(int(v.numpy().nbytes) for v in trainer.non_trainable.values())
    slots = len(make_optimizer(optimizer_spec).slot_names)
    if config.checkpoints.checkpoint_dir:
        check_writable_dir("--checkpoint_dir", config.checkpoints.checkpoint_dir,
                           MIN_FREE_BYTES + parameter_bytes * (1 + slots) + state_bytes)
    if config.outputs.output:
        check_writable_dir("--output", config.outputs.output, MIN_FREE_BYTES + parameter_bytes + state_bytes)


def _check_optimizer(spec: ModelSpec) -> OptimizerSpec:
    try:
        optimizer = spec.optimizer()
    except Exception as err:
        raise ModelSpecError(f"{spec.module_path}: optimizer() failed: {type(err).__name__}: {err}") from err
    try:
        return optimizer_spec_from_keras(optimizer)
    except UnsupportedOptimizerError as err:
        raise ModelSpecError(f"{spec.module_path}: {err}") from err


def check_eval_metrics(spec: ModelSpec) -> dict[str, Any]:
    """The metrics from eval_metrics_fn(), each a Keras Metric or a callable."""
    if spec.eval_metrics_fn is None:
        return {}
    import keras

    metrics = spec.eval_metrics_fn()
    if not isinstance(metrics, dict) or not metrics:
        raise ModelSpecError(
            f"{spec.module_path}: eval_metrics_fn() must return a non-empty dict "
            f"{{name: keras.metrics.Metric or fn(labels, predictions)}}. Received: {type(metrics).__name__}"
        )
    from elasticdl.model.metrics import flatten_metrics

    for name, entry in flatten_metrics(metrics).items():  # nested per output: {"probs": {"auc": AUC()}}
        metric = entry.metric
        if not isinstance(metric, keras.metrics.Metric) and not callable(metric):
            raise ModelSpecError(
                f"{spec.module_path}: eval_metrics_fn()[{name!r}] must be a keras.metrics.Metric "
                f"or a function (labels, predictions) -> per-example values. Received: {metric!r}"
            )
    return metrics


def _check_one_batch(spec, config, files, has_header, metrics, mode: Mode) -> tuple[Any, Any]:
    """(one batch of features, the model-built Trainer)."""
    import tensorflow as tf

    from elasticdl.model.trainer import Trainer, make_dataset

    path = next(p for p, n in files if n > 0 or is_kafka(p))
    n = min(config.training.minibatch_size, dict(files)[path] or config.training.minibatch_size)
    max_bad = config.data.max_bad_records if mode != Mode.PREDICTION else 0
    corrupt = []
    if is_kafka(path):
        records = sample_stream(path, n)
        n = len(records)
    elif config.data.records == "columns":  # a file other than Parquet is refused here, named
        records = read_columns(path, 0, n, config.data.columns)
    else:
        records = list(itertools.islice(read_records(path, 0, n, has_header, on_corrupt=corrupt.append,
                                                     columns=config.data.columns), n))
    positions = [i for i in range(n) if i not in {err.index for err in corrupt}]
    bad = [BadRecord(path, err.index, err.problem + " (the file is corrupt)") for err in corrupt]
    metadata = DatasetMetadata(record_format(path), getattr(records, "names", ()))
    _check_dataset_fn_does_not_batch(spec, records, mode, metadata)
    trainer = Trainer(spec, config.training.model_params, config.training.embedding_swap_threshold_mb)
    records, positions, found = _without_bad_records(spec, trainer, records, positions, mode, metadata, path)
    bad += found
    if len(bad) > max_bad:
        raise BadRecordError(bad, max_bad)
    for record in bad:
        logger.warning("bad record in the first batch, to be skipped (--max_bad_records=%d): %s", max_bad, record)
    n = len(records)
    dataset = make_dataset(spec, records, mode, metadata, n)
    try:
        batch = next(iter(dataset))
    except StopIteration:
        raise ModelSpecError(
            f"{spec.module_path}: dataset_fn produced no elements from {n} records of {path}"
        ) from None
    except Exception as err:
        raise ModelSpecError(
            f"{spec.module_path}: dataset_fn failed on records of {path}: {type(err).__name__}: {err}"
        ) from err
    if mode == Mode.PREDICTION:
        features = features_of(batch)
        _run_model(spec, trainer, features)
        return features, trainer
    features, labels, sample_weight = unpack(batch, spec, mode)
    predictions = _run_model(spec, trainer, features)
    if metrics:
        _check_metrics_on(spec, labels, predictions, sample_weight)
    if mode == Mode.EVALUATION:
        return features, trainer
    if sample_weight is not None:  # per-example values are what a weighted loss must return: no warning
        loss = _check_weighted_loss(spec, labels, predictions, sample_weight)
    else:
        try:
            loss = spec.loss(labels, predictions)
        except Exception as err:
            raise ModelSpecError(f"{spec.module_path}: loss(labels, predictions) failed: {err}") from err
    if int(tf.size(loss)) != 1:
        raise ModelSpecError(
            f"{spec.module_path}: loss(labels, predictions) must return a scalar; got shape "
            f"{tuple(loss.shape)}. Reduce it, e.g. with tf.reduce_mean."
        )
    _check_loss_shapes(spec, labels, predictions, weighted=sample_weight is not None)
    try:
        loss_value, grads = trainer.compute_gradients(features, labels, sample_weight)
    except Exception as err:
        raise ModelSpecError(
            f"{spec.module_path}: the gradients of loss(labels, predictions) failed: {describe_error(err)}"
        ) from err
    if all(isinstance(g, NonTrainableChange) for g in grads.values()):  # BatchNorm statistics are no gradient
        raise ModelSpecError(f"{spec.module_path}: the loss has no gradient for any trainable variable.")
    if not trainer.last_step_finite:
        what = f"the loss is {loss_value}" if not math.isfinite(loss_value) else "the gradients hold NaN or Inf"
        raise ModelSpecError(
            f"{spec.module_path}: on the first {n} records of {path}, {what} before any training. Look for "
            "NaN, Inf or huge values in the inputs and labels, and for log(0), sqrt(0) or a division by 0 "
            "in the model and loss() (e.g. clip probabilities, or use from_logits=True)."
        )
    logger.info(
        "model checked: %d trainable variables, %d parameters%s%s",
        len(trainer.variables),
        sum(int(v.numpy().size) for v in trainer.variables.values()),
        f"; {len(trainer.non_trainable)} non-trainable variables" if trainer.non_trainable else "",
        "".join(f"; embedding table {i.name} (rows of {i.dim}) on the parameter servers"
                for i in trainer.embeddings.infos.values()),
    )
    return features, trainer


def _check_dataset_fn_does_not_batch(spec: ModelSpec, records, mode: Mode, metadata: DatasetMetadata) -> None:
    """ElasticDL batches dataset_fn's examples itself (--minibatch_size): a dataset_fn that
    batches too would hand the model batches of batches."""
    import tensorflow as tf

    from elasticdl.model.trainer import raw_dataset

    try:
        dataset = spec.dataset_fn(raw_dataset(records), mode, metadata)
        graph = tf.compat.v1.GraphDef()
        graph.ParseFromString(dataset._as_serialized_graph().numpy())
    except Exception:
        return  # the checks that follow name what is wrong with dataset_fn
    ops = {node.op for node in graph.node}
    ops |= {node.op for function in graph.library.function for node in function.node_def}
    batching = sorted(op for op in ops if op in _BATCH_DATASET_OPS)
    if batching:
        raise ModelSpecError(
            f"{spec.module_path}: dataset_fn batches its dataset ({', '.join(batching)}), but ElasticDL "
            f"batches dataset_fn's examples itself (--minibatch_size). Remove .batch(...) (and padded_batch, "
            "ragged_batch, map_and_batch) from dataset_fn: return one (features, labels) example per element."
        )


_BATCH_DATASET_OPS = frozenset({
    "BatchDataset", "BatchDatasetV2", "ParallelBatchDataset", "PaddedBatchDataset", "PaddedBatchDatasetV2",
    "MapAndBatchDataset", "ExperimentalMapAndBatchDataset", "DenseToSparseBatchDataset",
    "ExperimentalDenseToSparseBatchDataset",
})


def _without_bad_records(spec, trainer, records, positions, mode: Mode, metadata: DatasetMetadata, path: str):
    """(records, their positions, bad records): the sample without the records that fail on their own.

    When every record fails (or none does on its own), nothing is taken out: it is not the
    data's fault, and the checks that follow name what is."""
    from elasticdl.model.records import example_check, find_bad_records

    def run_model(features):  # its errors as they are: a record the model rejects is a bad record
        trainer.ensure_built(features)
        return trainer.model(features, training=False)

    check = example_check(spec, mode, metadata, run_model)
    try:
        check(records)
        return records, positions, []
    except ModelSpecError:
        raise
    except Exception:
        pass
    try:
        if len(records) > 3 and all(_fails(check, records[i:i + 1]) for i in (0, len(records) // 2, len(records) - 1)):
            return records, positions, []  # three records spread over the sample: not one record's fault
        found = find_bad_records(records, check)
    except ModelSpecError:
        return records, positions, []  # a broken dataset_fn or model: the checks that follow say so
    if not found or len(found) == len(records):
        return records, positions, []
    drop = {i for i, _ in found}
    bad = [BadRecord(path, positions[i], reason) for i, reason in found]
    keep = [i for i in range(len(records)) if i not in drop]
    return select(records, keep), [positions[i] for i in keep], bad


def _fails(check, records) -> bool:
    try:
        check(records)
        return False
    except ModelSpecError:
        raise
    except Exception:
        return True


def _run_model(spec: ModelSpec, trainer, features):
    """The model on a batch of dataset_fn's features (building it first); its errors as ModelSpecError."""
    try:
        trainer.ensure_built(features)
        return trainer.model(features, training=False)
    except ModelSpecError:
        raise
    except Exception as err:
        raise ModelSpecError(
            f"{spec.module_path}: {spec.model_name} failed on a batch of dataset_fn's examples "
            f"(features {_shapes(features)}): {describe_error(err)}. Make dataset_fn yield the inputs "
            f"{spec.model_name} takes (names, shapes, dtypes), one example per element."
        ) from err


def _shapes(value) -> str:
    import tensorflow as tf

    try:
        shapes = tf.nest.map_structure(lambda t: tuple(tf.convert_to_tensor(t).shape), value)
    except Exception:
        return type(value).__name__
    return str(shapes)


def _check_loss_shapes(spec: ModelSpec, labels, predictions, weighted: bool = False) -> None:
    """The loss must not stretch the labels against the predictions (elasticdl/model/loss_check.py).
    ``weighted``: the user's own function is traced (its mean would warn of per-example values)."""
    from elasticdl.model.loss_check import label_broadcast

    found = label_broadcast(getattr(spec.loss, "__wrapped__", spec.loss) if weighted else spec.loss,
                            labels, predictions)
    if found is None:
        return
    raise ModelSpecError(
        f"{spec.module_path}: loss(labels, predictions) broadcasts labels of shape {found.labels_shape} "
        f"against predictions of shape {found.predictions_shape} (a {found.op} of shape "
        f"{found.result_shape}), so each example is compared with values that are not its own. Give the "
        "labels the predictions' shape (e.g. tf.one_hot(tf.reshape(labels, [-1]), num_classes), or "
        "tf.reshape(labels, tf.shape(predictions))), or use a loss that takes class ids "
        "(keras.losses.sparse_categorical_crossentropy)."
    )


def _check_weighted_loss(spec: ModelSpec, labels, predictions, sample_weight):
    """The loss weighted by dataset_fn's sample weights (elasticdl/model/sample_weight.py)."""
    try:
        return weighted_loss(spec.loss, labels, predictions, sample_weight, spec.module_path)
    except ModelSpecError:
        raise
    except Exception as err:
        raise ModelSpecError(
            f"{spec.module_path}: loss(labels, predictions) weighted by dataset_fn's sample_weight "
            f"(weights {_shapes(sample_weight)}) failed: {describe_error(err)}. Yield one weight per example."
        ) from err


def _check_metrics_on(spec: ModelSpec, labels, predictions, sample_weight=None) -> None:
    """Run every metric once on the sample batch: a metric that raises fails the submit."""
    from elasticdl.model.metrics import MetricsAccumulator, flatten_metrics

    for name, entry in flatten_metrics(spec.eval_metrics_fn()).items():
        try:
            accumulator = MetricsAccumulator({name: entry.metric} if entry.output is None
                                             else {entry.output: {name.split("/", 1)[1]: entry.metric}})
            accumulator.update(labels, predictions, sample_weight)
            accumulator.result()
        except Exception as err:
            raise ModelSpecError(
                f"{spec.module_path}: eval_metrics_fn()[{name!r}] failed on a batch of the data: "
                f"{type(err).__name__}: {err}. A metric must accept (labels, predictions)."
            ) from err


def _check_callbacks(spec: ModelSpec) -> None:
    """callbacks() runs now, so a typo in it fails the submit, not the job."""
    if spec.callbacks is None:
        return
    try:
        callbacks = spec.callbacks()
    except Exception as err:
        raise ModelSpecError(f"{spec.module_path}: callbacks() failed: {type(err).__name__}: {err}") from err
    if not isinstance(callbacks, (list, tuple)):
        raise ModelSpecError(
            f"{spec.module_path}: callbacks() must return a list of callbacks. Received: {type(callbacks).__name__}"
        )
    hooks = ("on_train_begin", "on_epoch_begin", "on_epoch_end", "on_train_end")
    for callback in callbacks:
        if not any(callable(getattr(callback, hook, None)) for hook in hooks):
            raise ModelSpecError(
                f"{spec.module_path}: callbacks() returned {callback!r}, which has none of {', '.join(hooks)}; "
                "subclass keras.callbacks.Callback or elasticdl.callbacks.Callback."
            )
