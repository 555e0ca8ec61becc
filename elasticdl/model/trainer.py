"""The TensorFlow side of a worker: datasets from raw records, gradients, parameters."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from elasticdl.data.columns import Columns
from elasticdl.mode import Mode
from elasticdl.model.class_weight import add_class_weights
from elasticdl.model.embedding.backends import (
    EmbeddingTables,
    FrozenTables,
    LocalTables,
    recording,
    use_embedding_backend,
)
from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.swap import DEFAULT_THRESHOLD_MB, swap_large_embeddings, threshold_bytes
from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.keras_generation import variable_name
from elasticdl.model.non_trainable import NonTrainableChange, lives_on_ps
from elasticdl.model.sample_weight import weighted_loss
from elasticdl.model.slicing import SliceError, with_slices_joined
from elasticdl.model.spec import DatasetMetadata, ModelSpec, ModelSpecError
from elasticdl.model.variable_assign import assign

logger = logging.getLogger(__name__)


def make_dataset(
    spec: ModelSpec,
    records: Sequence[bytes] | Columns,
    mode: Mode,
    metadata: DatasetMetadata,
    batch_size: int,
) -> tf.data.Dataset:
    """Raw records (bytes, or Parquet Columns) -> the model zoo's ``dataset_fn`` -> batches."""
    return user_dataset(spec, raw_dataset(records), mode, metadata).batch(batch_size)


def user_dataset(spec: ModelSpec, raw: tf.data.Dataset, mode: Mode, metadata: DatasetMetadata) -> tf.data.Dataset:
    """``dataset_fn``'s examples of the raw records, each with its class weight when training
    with class weights (as model.fit adds them): what every pipeline batches."""
    dataset = spec.dataset_fn(raw, mode, metadata)
    if not isinstance(dataset, tf.data.Dataset):
        raise ModelSpecError(
            f"{spec.module_path}: dataset_fn must return a tf.data.Dataset. "
            f"Received: {type(dataset).__name__}"
        )
    if spec.class_weight and mode == Mode.TRAINING:  # fit(class_weight=...) weighs training only
        dataset = add_class_weights(dataset, spec.class_weight, spec.module_path)
    return dataset


def raw_dataset(records: Sequence[bytes] | Columns) -> tf.data.Dataset:
    """What ``dataset_fn`` receives: a string per record, or for Columns a dict of column tensors per row."""
    if isinstance(records, Columns):
        return tf.data.Dataset.from_tensor_slices(column_tensors(records.layout, records.components()))
    return tf.data.Dataset.from_tensor_slices(tf.constant(list(records), dtype=tf.string))


def column_dtypes(layout: Sequence[tuple[str, str, bool]]) -> list[tf.DType]:
    """The dtypes of ``Columns.components()`` for Columns of this ``layout``."""
    dtypes = []
    for _name, kind, is_list in layout:
        dtypes.append(tf.string if kind == "string" else tf.as_dtype(kind))
        if is_list:
            dtypes.append(tf.int64)
    return dtypes


def column_tensors(layout: Sequence[tuple[str, str, bool]], components: Sequence[Any]) -> dict[str, Any]:
    """{column name: values} of some rows, a list column as a RaggedTensor (a row of it: a 1-D tensor)."""
    tensors, position = {}, 0
    for name, kind, is_list in layout:
        values = tf.convert_to_tensor(components[position], tf.string if kind == "string" else kind)
        position += 1
        if is_list:
            values = tf.RaggedTensor.from_row_splits(values, components[position], validate=False)
            position += 1
        tensors[name] = values
    return tensors


class Trainer:
    """A model built from the model zoo, with parameters set from and gradients sent to the PS.

    Its ``elasticdl.layers.Embedding`` layers (and Keras Embeddings larger than
    ``embedding_swap_threshold_mb``, swapped for them) read rows from ``self.embeddings``:
    in-process tables until ``connect(ps_client)``, or a frozen ``embedding_source`` (export).
    """

    def __init__(
        self,
        spec: ModelSpec,
        model_params: dict[str, Any],
        embedding_swap_threshold_mb: float = DEFAULT_THRESHOLD_MB,
        embedding_source: Any = None,
        embedding_policy: TablePolicy | None = None,
    ):
        """``embedding_policy``: the bounds of the tables the swap makes (swap.swap_policy)."""
        self.spec = spec
        self.model_params = model_params
        self.embedding_swap_threshold_mb = embedding_swap_threshold_mb
        self.embeddings = EmbeddingTables(embedding_source)
        with use_embedding_backend(self.embeddings), swap_large_embeddings(
            threshold_bytes(embedding_swap_threshold_mb), embedding_policy
        ):
            self.model = spec.build_model(model_params)
        self.variables: dict[str, tf.Variable] = {}  # trainable, by path
        # Non-trainable float variables by path (BatchNorm moving statistics): held by the PS
        # too; a step sends how it changed them (elasticdl/model/non_trainable.py).
        self.non_trainable: dict[str, tf.Variable] = {}
        self._built = False
        self._sample_features = None
        self._local_optimizer = None
        self._last_dense: dict = {}  # the last step's gradient tensors and their numpy views, by name
        self._train_step = tf.function(self._train_step_eager, reduce_retracing=True)
        self._traced = False
        # Whether the last compute_gradients gave a finite loss and finite gradients.
        self.last_step_finite = True

    @property
    def built(self) -> bool:
        return self._built

    def connect(self, ps_client) -> None:
        """Embedding rows come from (and row gradients go to) the parameter servers from now on."""
        self.embeddings.use(ps_client)

    def ensure_built(self, features: Any) -> None:
        """Create the variables by calling the model once (subclassed models need a batch)."""
        if self.built:
            return
        if not self.model.built or not self.model.trainable_variables:
            source = self.embeddings.source
            if not self.embeddings.frozen:
                # Building needs shapes, not rows: the PS may not know the tables yet.
                self.embeddings.use(LocalTables())
            try:
                with use_embedding_backend(self.embeddings):
                    self.model(features, training=False)
            finally:
                self.embeddings.use(source)
        variables = {}
        for var in self.model.trainable_variables:
            name = variable_name(var)  # Keras 3's path, or Keras 2's name
            if name in variables:
                raise ModelSpecError(
                    f"{self.spec.module_path}: two trainable variables are named {name!r}; "
                    "give the layers distinct names."
                )
            variables[name] = var
        if not variables and not self.embeddings.infos:
            raise ModelSpecError(f"{self.spec.module_path}: the model has no trainable variables.")
        non_trainable = {}
        for var in self.model.non_trainable_variables:
            if not lives_on_ps(var):  # integer state (seed counters) stays with each worker
                continue
            name = variable_name(var)
            if name in variables or name in non_trainable:
                raise ModelSpecError(
                    f"{self.spec.module_path}: two variables are named {name!r}; give the layers distinct names."
                )
            non_trainable[name] = var
        self.variables = variables
        self.non_trainable = non_trainable
        self._backend_variables = {name: _backend_variable(var) for name, var in {**variables, **non_trainable}.items()}
        self._sample_features = features
        self._built = True
        from elasticdl.model.export import record_input_signature

        record_input_signature(self.model, features)

    def get_params(self) -> dict[str, np.ndarray]:
        """Every variable the PS holds: the trainable ones and the non-trainable float ones."""
        return {name: var.numpy() for name, var in {**self.variables, **self.non_trainable}.items()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Whole variables, or slices of them written into their rows (elasticdl/model/slicing.py):
        pass every PS's part in one call, so that a sliced variable is assigned once, whole."""
        try:
            params = with_slices_joined(params, self._backend_variables.get)
        except SliceError as err:
            raise ModelSpecError(str(err)) from None
        for name, value in params.items():
            var = self._backend_variables.get(name)
            if var is None:
                raise ModelSpecError(
                    f"the parameter server holds {name!r}, which this model does not have: "
                    "was the checkpoint made by a different model?"
                )
            shape = tuple(np.shape(value))
            if shape != tuple(var.shape):
                raise ModelSpecError(
                    f"the parameter server holds {name!r} with shape {shape}, this model's "
                    f"variable has {tuple(var.shape)}: was the checkpoint made by a different model?"
                )
            assign(var, value)  # an aligned received array: shared, not copied

    def apply_locally(self, grads: dict[str, np.ndarray], learning_rate: float | None) -> None:
        """Async with --get_model_steps > 1: train on our own updates until the next pull."""
        if self._local_optimizer is None:
            self._local_optimizer = self.spec.optimizer()
            build = getattr(self._local_optimizer, "build", None)  # Keras 2's legacy optimizers have none
            if build is not None:
                build(list(self.variables.values()))  # its slots: made outside the tf.function
            # Traced: Keras's eager apply_gradients took 32 ms per step on the 5M-parameter model
            # (more than the gradient, 20 ms), the traced one a few (docs/benchmarks.md).
            self._local_apply = tf.function(self._apply_local_eager)
        if learning_rate is not None:  # 0 is a rate: no update
            self._local_optimizer.learning_rate = learning_rate
        names = tuple(name for name in self.variables if name in grads)
        if names:
            self._local_apply(names, [self._as_tensor(name, grads[name]) for name in names])
        for name, change in grads.items():
            if isinstance(change, NonTrainableChange):
                self._backend_variables[name].assign_add(change.values)

    def _as_tensor(self, name: str, grad: np.ndarray):
        """The last step's own gradient tensor when ``grad`` is its numpy view: converting the
        view back copied it (11 ms for 20 MB)."""
        tensor, view = self._last_dense.get(name, (None, None))
        return tensor if view is grad else tf.convert_to_tensor(grad)

    def _apply_local_eager(self, names: tuple[str, ...], grads: list) -> None:
        self._local_optimizer.apply_gradients(zip(grads, [self.variables[name] for name in names]))

    def compute_gradients(
        self, features: Any, labels: Any, sample_weight: Any = None
    ) -> tuple[float, dict[str, np.ndarray | IndexedRows | NonTrainableChange]]:
        """The loss and the gradients: dense arrays by variable path, ``IndexedRows`` by table name,
        and a ``NonTrainableChange`` for each non-trainable variable the step changed.
        ``sample_weight`` (dataset_fn's third element) weighs the examples as ``model.fit`` does.

        The step leaves the non-trainable variables as they were: they change only by what the
        PS sends (or ``apply_locally``), so a step computed again starts from the same values.
        """
        self.embeddings.error = None
        if not self._traced:
            self._trace_any_batch_size(features, labels, sample_weight)
        try:
            loss, grads, rows, changes, changed, finite = self._train_step(features, labels, sample_weight)
        except tf.errors.OpError as err:
            if self.embeddings.error is not None:  # a row lookup failed: raise what it raised
                raise self.embeddings.error from err
            raise
        names = list(self.variables)
        # Read-only views of the gradient tensors: `.numpy()` would copy them (5 ms for 20 MB).
        out: dict[str, np.ndarray | IndexedRows] = {
            name: np.asarray(grad) for name, grad in zip(names, grads) if grad is not None
        }
        self._last_dense = {name: (grad, out[name]) for name, grad in zip(names, grads) if grad is not None}
        for table, (ids, values) in rows.items():
            out[table] = IndexedRows(ids.numpy(), values.numpy())
        for name, change, moved in zip(self.non_trainable, changes, changed):
            if moved:  # a frozen layer's weights never move: nothing to send for them
                out[name] = NonTrainableChange(np.asarray(change))
        self.last_step_finite = bool(finite)
        return float(loss), out

    def _trace_any_batch_size(self, features: Any, labels: Any, sample_weight: Any) -> None:
        """Trace the step once for every batch size: an epoch's last, smaller batch would
        otherwise trace it again (a few hundred ms, more than a small model's task)."""
        self._traced = True
        try:
            specs = tf.nest.map_structure(_any_batch_size, (features, labels))
            if sample_weight is not None:  # None stays a Python constant of the trace
                specs = (*specs, tf.nest.map_structure(_any_batch_size, sample_weight))
            self._train_step.get_concrete_function(*specs)
        except Exception as err:  # a model that needs its batch size: trace per shape, as before
            logger.debug("no batch-size-independent trace (%s); tracing per batch shape", err)

    def serving_model(self, fetch_table):
        """The model with each embedding table pulled in whole (``fetch_table(name) -> (ids, rows)``),
        so it runs (and exports) without parameter servers; the model itself when it has no tables."""
        if not self.embeddings.infos:
            return self.model
        serving = Trainer(self.spec, self.model_params, self.embedding_swap_threshold_mb, FrozenTables(fetch_table))
        serving.ensure_built(self._sample_features)
        serving.set_params(self.get_params())
        return serving.model

    def _train_step_eager(self, features, labels, sample_weight=None):
        # Reads and assigns of one variable run in program order inside a tf.function.
        states = [self._backend_variables[name] for name in self.non_trainable]
        before = [var.read_value() for var in states]
        with tf.GradientTape() as tape, recording(tape) as recorder:
            predictions = self.model(features, training=True)
            loss = weighted_loss(self.spec.loss, labels, predictions, sample_weight, self.spec.module_path)
            if self.model.losses:  # regularization: never weighted, as in model.fit
                loss += tf.add_n(self.model.losses)
        variables = list(self.variables.values())
        grads = tape.gradient(loss, variables + recorder.sources)
        dense = [tf.convert_to_tensor(g) if g is not None else None for g in grads[: len(variables)]]
        row_gradients = recorder.row_gradients(grads[len(variables):])
        after = [var.read_value() for var in states]
        changes = [new - old for new, old in zip(after, before)]
        changed = [tf.reduce_any(tf.not_equal(new, old)) for new, old in zip(after, before)]
        for var, old in zip(states, before):
            var.assign(old)
        finite = _all_finite(loss, dense + changes, row_gradients)
        return loss, dense, row_gradients, changes, changed, finite


def _all_finite(loss, dense, row_gradients):
    """One boolean for the step: a NaN or Inf anywhere makes the sum of each gradient (and each
    non-trainable change) non-finite (one cheap pass over each, where an elementwise check would
    allocate a mask per variable)."""
    sums = [tf.reduce_sum(tf.cast(loss, tf.float32))]
    sums += [tf.reduce_sum(tf.cast(g, tf.float32)) for g in dense if g is not None]
    sums += [tf.reduce_sum(tf.cast(values, tf.float32)) for _, values in row_gradients.values()]
    return tf.reduce_all(tf.math.is_finite(tf.stack(sums)))


def _backend_variable(var) -> tf.Variable:
    """The tf.Variable under a Keras variable: assigning it skips Keras's per-call conversions
    and checks (a third of a small model's step); set_params checks the shape itself."""
    inner = getattr(var, "value", var)
    return inner if isinstance(inner, tf.Variable) else var


def _any_batch_size(value):
    spec = tf.type_spec_from_value(value)
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)
    return spec
