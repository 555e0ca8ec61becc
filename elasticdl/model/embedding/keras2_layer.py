"""``elasticdl.layers.Embedding`` for Keras 2 (``tf_keras``) models, and the original ElasticDL's
``feature_column.embedding_column`` built on it: the table on the parameter servers.

The lookups, the combiners, the gradient recording and the frozen (exported) form are those of
the Keras 3 layer (elasticdl/model/embedding/layer.py), whose methods this class reuses; only
the Keras base class, the weights and the mask differ. Imported only under Keras 2.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras
from tensorflow.python.feature_column import feature_column_v2 as fc_lib

from elasticdl.model.embedding import layer as keras3_layer
from elasticdl.model.embedding.backends import current_backend
from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.regularizer import RowRegularizer

_Keras3Embedding = keras3_layer.Embedding


def _keras3_initializer(initializer):
    """A tf_keras initializer as the same Keras 3 one (the PS draws rows from its spec)."""
    if initializer is None or isinstance(initializer, (str, dict)):
        return initializer or "uniform"
    return {"class_name": type(initializer).__name__, "config": initializer.get_config()}


class Embedding(tf_keras.layers.Layer):
    """Keras 2's ``elasticdl.layers.Embedding``: same arguments and behaviour (see layer.py)."""

    mode = _Keras3Embedding.mode
    table_info = _Keras3Embedding.table_info
    call = _Keras3Embedding.call
    _ids = _Keras3Embedding._ids
    _bags = _Keras3Embedding._bags
    _combine = _Keras3Embedding._combine
    _check = _Keras3Embedding._check
    _rows = _Keras3Embedding._rows

    def __init__(self, output_dim: int, input_dim: int | None = None, embeddings_initializer="uniform",
                 mask_zero: bool = False, input_length: int | None = None, combiner: str | None = None,
                 admit_min_count: int = 1, admit_probability: float = 1.0, ttl_versions: int = 0, max_rows: int = 0,
                 embeddings_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self._regularizer = RowRegularizer.from_keras(embeddings_regularizer)  # as the Keras 3 layer
        import keras

        # The table's bounds on the PS, as the Keras 3 layer takes them (table_info reads them).
        self.policy = TablePolicy(admit_min_count, admit_probability, ttl_versions, max_rows)

        if not isinstance(output_dim, int) or isinstance(output_dim, bool) or output_dim <= 0:
            raise ValueError(f"`output_dim` must be a positive integer. Received: output_dim={output_dim!r}")
        if combiner not in keras3_layer.COMBINERS:
            raise ValueError(f"`combiner` must be one of None, 'sum', 'mean', 'sqrtn'. Received: combiner={combiner!r}")
        self.output_dim, self.input_dim = output_dim, input_dim
        self.embeddings_initializer = keras.initializers.get(_keras3_initializer(embeddings_initializer))
        self._initializer = keras3_layer.initializer_spec(self.embeddings_initializer, input_dim, output_dim)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero and combiner is None
        self.input_length = input_length
        self.combiner = combiner
        self._backend = current_backend()
        self.table_name: str | None = None

    def build(self, input_shape=None):
        self.table_name = f"{self.name}/embeddings"  # layer names are unique in a model
        info = self.table_info()
        if self._backend is None:
            if self.input_dim is None:
                raise ValueError(f"Embedding {self.name!r} has no input_dim: outside an ElasticDL job it needs its size.")
            rows = keras3_layer.initial_rows(info.initializer, np.arange(self.input_dim, dtype=np.int64), self.output_dim)
            self.embeddings = self.add_weight(
                name="embeddings", shape=(self.input_dim, self.output_dim),
                initializer=lambda shape, dtype=None: rows, trainable=True, regularizer=self._regularizer,
            )
        else:
            self._backend.register(info)
            if self._backend.frozen:
                ids, rows = self._backend.table(self.table_name)
                order = np.argsort(ids, kind="stable")
                keys = np.concatenate([np.asarray(ids, np.int64)[order], [np.iinfo(np.int64).max]])
                table = np.concatenate([np.asarray(rows, np.float32)[order], np.zeros((1, self.output_dim), np.float32)])
                self.ids = self.add_weight(name="ids", shape=keys.shape, dtype=tf.int64,
                                           initializer=lambda shape, dtype=None: keys, trainable=False)
                self.embeddings = self.add_weight(name="embeddings", shape=table.shape,
                                                  initializer=lambda shape, dtype=None: table, trainable=False)
        super().build(input_shape)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or self.combiner is not None:
            return None
        return tf.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if self.combiner is not None:
            return tf.TensorShape([input_shape[0], self.output_dim])
        return input_shape.concatenate([self.output_dim])

    def get_config(self):
        config = super().get_config()
        config.update(output_dim=self.output_dim, input_dim=self.input_dim, mask_zero=self.mask_zero,
                      input_length=self.input_length, combiner=self.combiner, **self.policy.to_dict())
        if self._regularizer:  # in Keras 3's form, which __init__ reads back
            import keras

            config["embeddings_regularizer"] = keras.regularizers.serialize(self._regularizer.to_keras())
        return config


class _EmbeddingColumn(fc_lib.EmbeddingColumn):
    """``tf.feature_column.embedding_column`` whose rows come from an ``Embedding`` with a
    combiner (the table on the parameter servers) instead of a local variable."""

    def create_state(self, state_manager):
        # DenseFeatures tracks what is set on it: the layer's weights (local or exported) go
        # with the model.
        owner = getattr(state_manager, "_layer", None)
        if owner is not None:
            setattr(owner, f"_elasticdl_{self.name}", self._layer)

    def get_dense_tensor(self, transformation_cache, state_manager, training=None):
        sparse = self.categorical_column.get_sparse_tensors(transformation_cache, state_manager)
        if sparse.weight_tensor is not None:
            raise ValueError(
                f"embedding_column({self.categorical_column.name!r}): weighted categorical columns are not "
                "supported with tables on the parameter servers; use tf.feature_column.embedding_column."
            )
        return self._layer(sparse.id_tensor, training=training)


def embedding_column(categorical_column, dimension: int, combiner: str = "mean", initializer=None, **_ignored):
    """An embedding column of ``categorical_column`` with ``dimension``-wide rows on the PS.

    ``combiner`` ("mean", "sum" or "sqrtn") combines the rows of an example's ids; an example
    without ids gets a zero row. ``initializer`` is a Keras initializer (default: uniform in
    [-0.05, 0.05], as ``elasticdl.layers.Embedding``).
    """
    if combiner not in ("mean", "sum", "sqrtn"):
        raise ValueError(f"`combiner` must be 'mean', 'sum' or 'sqrtn'. Received: combiner={combiner!r}")
    column = _EmbeddingColumn(
        categorical_column=categorical_column, dimension=dimension, combiner=combiner, initializer=None,
        ckpt_to_load_from=None, tensor_name_in_ckpt=None, max_norm=None, trainable=True,
        use_safe_embedding_lookup=True,
    )
    column._layer = Embedding(
        dimension, input_dim=getattr(categorical_column, "num_buckets", None),
        embeddings_initializer=initializer or "uniform", combiner=combiner,
        name=f"{categorical_column.name}_embedding",
    )
    return column
