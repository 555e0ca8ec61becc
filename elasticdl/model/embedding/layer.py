"""``elasticdl.layers.Embedding``: an embedding whose table lives on the parameter servers."""

from __future__ import annotations

import math
import zlib

import keras
import numpy as np
import tensorflow as tf

from elasticdl.model.embedding.backends import current_backend, current_recorder
from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.regularizer import RowRegularizer
from elasticdl.model.embedding.table import TableInfo, initial_rows

COMBINERS = (None, "sum", "mean", "sqrtn")
_INT64_MAX = np.iinfo(np.int64).max


def initializer_spec(initializer, input_dim: int | None = None, output_dim: int | None = None) -> dict:
    """The PS's form of a Keras initializer: a distribution, its parameters and a seed (or None).

    RandomUniform, RandomNormal, TruncatedNormal, Zeros, Ones and Constant work for any table;
    the variance-scaling family (GlorotUniform, HeNormal, ...) needs ``input_dim`` (its fans).
    """
    init = keras.initializers.get(initializer)
    config = init.get_config()
    seed = config.get("seed")
    seed = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else None
    kind = type(init).__name__
    if kind == "RandomUniform":
        return {"distribution": "uniform", "minval": float(config["minval"]), "maxval": float(config["maxval"]), "seed": seed}
    if kind in ("RandomNormal", "TruncatedNormal"):
        distribution = "normal" if kind == "RandomNormal" else "truncated_normal"
        return {"distribution": distribution, "mean": float(config["mean"]), "stddev": float(config["stddev"]), "seed": seed}
    if kind in ("Zeros", "Ones", "Constant"):
        value = {"Zeros": 0.0, "Ones": 1.0}.get(kind, config.get("value"))
        if not isinstance(value, (int, float)):
            raise ValueError(f"`embeddings_initializer` Constant needs a scalar value. Received: {value!r}")
        return {"distribution": "constant", "value": float(value), "seed": 0}
    if isinstance(init, keras.initializers.VarianceScaling):
        if input_dim is None:
            raise ValueError(
                f"`embeddings_initializer` {kind} scales by the table's fans, which need `input_dim`; "
                "pass input_dim or use 'uniform', 'normal' or 'truncated_normal'."
            )
        fan = {"fan_in": input_dim, "fan_out": output_dim, "fan_avg": (input_dim + output_dim) / 2}[init.mode]
        scale = init.scale / max(1.0, fan)
        if init.distribution == "uniform":
            limit = math.sqrt(3.0 * scale)
            return {"distribution": "uniform", "minval": -limit, "maxval": limit, "seed": seed}
        if init.distribution == "truncated_normal":
            stddev = math.sqrt(scale) / 0.87962566103423978
            return {"distribution": "truncated_normal", "mean": 0.0, "stddev": stddev, "seed": seed}
        return {"distribution": "normal", "mean": 0.0, "stddev": math.sqrt(scale), "seed": seed}
    raise ValueError(
        f"`embeddings_initializer` {kind} is not supported by elasticdl.layers.Embedding; use "
        "RandomUniform ('uniform'), RandomNormal ('normal'), TruncatedNormal, Zeros, Ones, Constant, "
        "or (with input_dim) a variance-scaling one such as GlorotUniform."
    )


class _PerIdInitializer(keras.initializers.Initializer):
    """A local table initialized exactly as the parameter servers initialize each id's row."""

    def __init__(self, spec: dict):
        self.spec = spec

    def __call__(self, shape, dtype=None):
        return initial_rows(self.spec, np.arange(shape[0], dtype=np.int64), shape[1])

    def get_config(self):
        return {"spec": self.spec}


class Embedding(keras.layers.Layer):
    """Maps integer ids to dense rows, like ``keras.layers.Embedding``, with the table on the PS.

    In an ElasticDL job the table is sharded over the parameter servers (row of id ``i`` on
    PS ``i % num_ps``) and has no fixed size: a worker looks up only the unique ids of its
    batch, an id seen for the first time gets a row from ``embeddings_initializer`` (the
    same row on every PS and in every run: it is a function of the id and a seed), and the
    gradient goes back as one summed row per unique id. Built outside a job (no parameter
    servers), the layer holds an ordinary ``(input_dim, output_dim)`` table and behaves like
    ``keras.layers.Embedding``.

    Args:
        output_dim: width of each row.
        input_dim: the vocabulary size. Optional with parameter servers (ids are then any
            int64 >= 0); when given, ids must be below it. Required for a local run.
        embeddings_initializer: RandomUniform ("uniform", the default, in [-0.05, 0.05]),
            RandomNormal, TruncatedNormal, Zeros, Ones, Constant; with ``input_dim`` also the
            variance-scaling initializers (GlorotUniform, HeNormal, ...).
        mask_zero: id 0 is padding (as in Keras): the layer produces a mask.
        input_length: accepted for compatibility with older Keras code; unused.
        combiner: None, or "sum", "mean", "sqrtn" to combine the rows of each example's
            ids (a ``tf.RaggedTensor``, a ``tf.SparseTensor`` or a dense ``[batch, n]``
            tensor of ids) into one row: the output is ``[batch, output_dim]``. An example
            without ids gets a zero row.
        admit_min_count: on the PS, an id gets a row at its Nth sighting (a training update
            carrying it); until then it reads the zero row and its gradient is dropped. 1 (the
            default): at once.
        admit_probability: else each sighting admits the id with this probability (1: off).
        ttl_versions: a row not updated for this many model versions is removed (0: never).
        max_rows: at most this many rows per parameter server; the least recently updated go
            first (0: no cap). An evicted id that comes back starts as a new row.
            See docs/embeddings.md, "Bounded tables". Unused outside a job.
        embeddings_regularizer: None, or an L1, L2 or L1L2 regularizer ("l1", "l2",
            ``keras.regularizers.L2(1e-6)``, ...). With parameter servers it penalizes the rows
            the batch looks up (each unique id once per lookup), not the whole table as Keras
            does; see docs/embeddings.md, "Regularizers".

    Example::

        ids = keras.Input(shape=(8,), dtype="int64", name="ids")
        rows = elasticdl.layers.Embedding(16, input_dim=1_000_000, name="items")(ids)  # [batch, 8, 16]
    """

    def __init__(
        self,
        output_dim: int,
        input_dim: int | None = None,
        embeddings_initializer="uniform",
        mask_zero: bool = False,
        input_length: int | None = None,
        combiner: str | None = None,
        admit_min_count: int = 1,
        admit_probability: float = 1.0,
        ttl_versions: int = 0,
        max_rows: int = 0,
        embeddings_regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # A RegularizerError (a ValueError) names what to use instead.
        self._regularizer = RowRegularizer.from_keras(embeddings_regularizer)
        # Refused here (PolicyError is a ValueError naming the argument), not on the PS.
        self.policy = TablePolicy(admit_min_count, admit_probability, ttl_versions, max_rows)
        if not isinstance(output_dim, int) or isinstance(output_dim, bool) or output_dim <= 0:
            raise ValueError(f"`output_dim` must be a positive integer. Received: output_dim={output_dim!r}")
        if input_dim is not None and (not isinstance(input_dim, int) or isinstance(input_dim, bool) or input_dim <= 0):
            raise ValueError(f"`input_dim` must be None or a positive integer. Received: input_dim={input_dim!r}")
        if combiner not in COMBINERS:
            raise ValueError(f"`combiner` must be one of None, 'sum', 'mean', 'sqrtn'. Received: combiner={combiner!r}")
        self.output_dim = output_dim
        self.input_dim = input_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self._initializer = initializer_spec(self.embeddings_initializer, input_dim, output_dim)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero and combiner is None
        self.input_length = input_length
        self.combiner = combiner
        self.autocast = False
        self._backend = current_backend()
        self.table_name: str | None = None

    @property
    def mode(self) -> str:
        """"local" (a Keras table), "ps" (rows from the parameter servers) or "frozen" (exported)."""
        if self._backend is None:
            return "local"
        return "frozen" if self._backend.frozen else "ps"

    def table_info(self) -> TableInfo:
        spec = dict(self._initializer)
        if spec["seed"] is None:  # a stable seed per table, so every process agrees on it
            spec["seed"] = zlib.crc32(self.table_name.encode()) & 0x7FFFFFFF
        return TableInfo(self.table_name, self.output_dim, spec, self.policy)

    def build(self, input_shape=None):
        self.table_name = f"{self.path}/embeddings"
        info = self.table_info()
        if self._backend is None:
            if self.input_dim is None:
                raise ValueError(
                    f"Embedding {self.name!r} has no input_dim: outside an ElasticDL job (no parameter "
                    "servers) the layer holds a local table and needs its size."
                )
            self.embeddings = self.add_weight(
                shape=(self.input_dim, self.output_dim), initializer=_PerIdInitializer(info.initializer),
                name="embeddings", trainable=True,
                regularizer=self._regularizer.to_keras() if self._regularizer else None,
            )
            return
        self._backend.register(info)
        if self._backend.frozen:
            ids, rows = self._backend.table(self.table_name)
            order = np.argsort(ids, kind="stable")
            # A sentinel key after the real ids, and the default (zero) row after the real rows:
            # an id never trained maps to that row.
            keys = np.concatenate([np.asarray(ids, np.int64)[order], [_INT64_MAX]])
            table = np.concatenate([np.asarray(rows, np.float32)[order], np.zeros((1, self.output_dim), np.float32)])
            self.ids = self.add_weight(
                shape=keys.shape, dtype="int64", initializer=lambda shape, dtype=None: keys, name="ids", trainable=False
            )
            self.embeddings = self.add_weight(
                shape=table.shape, initializer=lambda shape, dtype=None: table, name="embeddings", trainable=False
            )

    def call(self, inputs, training=None):
        if self.combiner is None:
            ids = self._ids(inputs)
            rows = self._rows(tf.reshape(ids, [-1]), training)
            out = tf.reshape(rows, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))
        else:
            flat, segments, batch = self._bags(inputs)
            rows = self._rows(flat, training)
            out = self._combine(rows, segments, batch)
        return tf.cast(out, self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or self.combiner is not None:
            return None
        return keras.ops.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape):
        if self.combiner is not None:
            return (input_shape[0], self.output_dim)
        return (*input_shape, self.output_dim)

    def compute_output_spec(self, inputs):
        ragged = getattr(inputs, "ragged", False) and self.combiner is None
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype, ragged=ragged)

    def get_config(self):
        config = super().get_config()
        config.update(
            output_dim=self.output_dim,
            input_dim=self.input_dim,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
            mask_zero=self.mask_zero,
            input_length=self.input_length,
            combiner=self.combiner,
            **self.policy.to_dict(),
        )
        if self._regularizer:
            config["embeddings_regularizer"] = keras.regularizers.serialize(self._regularizer.to_keras())
        return config

    # ------------------------------------------------------------ lookups

    def _ids(self, ids):
        if ids.dtype.is_floating:  # as keras.layers.Embedding does
            ids = tf.cast(ids, tf.int64)
        elif not ids.dtype.is_integer:
            raise TypeError(f"Embedding {self.name!r} needs integer ids. Received dtype {ids.dtype.name}")
        return tf.cast(ids, tf.int64)

    def _bags(self, inputs):
        """(flat ids, example index of each id, batch size) of a ragged, sparse or dense [batch, n] input."""
        if isinstance(inputs, tf.RaggedTensor):
            if inputs.ragged_rank != 1:
                raise ValueError(f"Embedding {self.name!r} with a combiner takes [batch, None] ragged ids")
            return self._ids(inputs.values), inputs.value_rowids(), inputs.nrows()
        if isinstance(inputs, tf.SparseTensor):
            return self._ids(inputs.values), inputs.indices[:, 0], inputs.dense_shape[0]
        ids = self._ids(inputs)
        if ids.shape.rank != 2:
            raise ValueError(
                f"Embedding {self.name!r} with a combiner takes [batch, n] ids (or ragged/sparse ones). "
                f"Received shape {ids.shape}"
            )
        batch, width = tf.shape(ids, out_type=tf.int64)[0], tf.shape(ids, out_type=tf.int64)[1]
        return tf.reshape(ids, [-1]), tf.repeat(tf.range(batch), width), batch

    def _combine(self, rows, segments, batch):
        total = tf.math.unsorted_segment_sum(rows, segments, batch)
        if self.combiner == "sum":
            return total
        counts = tf.math.unsorted_segment_sum(tf.ones_like(segments, tf.float32), segments, batch)
        if self.combiner == "sqrtn":
            counts = tf.sqrt(counts)
        return tf.math.divide_no_nan(total, counts[:, None])

    def _check(self, ids):
        checks = [tf.debugging.assert_non_negative(ids, message=f"Embedding {self.name!r}: ids must be >= 0")]
        if self.input_dim is not None:
            checks.append(tf.debugging.assert_less(
                ids, tf.constant(self.input_dim, tf.int64), message=f"Embedding {self.name!r}: ids must be < input_dim={self.input_dim}"
            ))
        with tf.control_dependencies(checks):
            return tf.identity(ids)

    def _rows(self, ids, training):
        """The row of each id in ``ids`` (int64 [n]) -> float32 [n, output_dim]."""
        mode = self.mode
        if mode == "local":
            return tf.gather(self.embeddings, ids)
        if mode == "frozen":
            position = tf.searchsorted(self.ids, ids, side="left", out_type=tf.int64)
            found = tf.equal(tf.gather(self.ids, position), ids)
            return tf.gather(self.embeddings, tf.where(found, position, tf.shape(self.ids, out_type=tf.int64)[0] - 1))
        ids = self._check(ids)
        unique, index = tf.unique(ids, out_idx=tf.int64)
        backend, name, dim, create = self._backend, self.table_name, self.output_dim, bool(training)

        def fetch(unique_ids):
            values = unique_ids.numpy()
            if values.size == 0:
                return np.zeros((0, dim), np.float32)
            return backend.lookup(name, values, create)

        rows = tf.ensure_shape(tf.py_function(fetch, [unique], tf.float32), [None, dim])
        recorder = current_recorder()
        if recorder is not None:
            recorder.watch(name, unique, rows)
        if self._regularizer is not None:
            # The touched rows' penalty (the Trainer adds model.losses to the loss): the tape
            # gives those rows the regularizer's gradient with their data gradient.
            self.add_loss(self._regularizer.penalty(rows))
        return tf.gather(rows, index)
