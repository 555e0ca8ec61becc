"""elasticdl.layers.Embedding on its own: local (Keras-like), PS-backed (in-process tables), frozen."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl.layers import Embedding
from elasticdl.model.embedding.backends import EmbeddingTables, FrozenTables, use_embedding_backend
from elasticdl.model.embedding.layer import initializer_spec
from elasticdl.model.embedding.table import initial_rows


def ps_backed(*args, **kwargs) -> tuple[Embedding, EmbeddingTables]:
    tables = EmbeddingTables()
    with use_embedding_backend(tables):
        return Embedding(*args, **kwargs), tables


def test_local_layer_behaves_like_keras_embedding():
    ids = np.array([[1, 0, 7], [7, 7, 2]], np.int64)
    ours = Embedding(3, input_dim=10, mask_zero=True, name="emb")
    theirs = keras.layers.Embedding(10, 3, mask_zero=True, name="emb")
    out = ours(ids)
    theirs.build()
    theirs.set_weights(ours.get_weights())
    assert ours.mode == "local" and [w.path for w in ours.weights] == ["emb/embeddings"]
    np.testing.assert_array_equal(out.numpy(), theirs(ids).numpy())
    np.testing.assert_array_equal(ours.compute_mask(ids).numpy(), theirs.compute_mask(ids).numpy())
    # Its local table starts from the rows the PS would create for those ids.
    np.testing.assert_array_equal(ours.embeddings.numpy(), initial_rows(ours.table_info().initializer, np.arange(10), 3))
    # Float ids are cast, as Keras does; ids must be below input_dim.
    np.testing.assert_array_equal(ours(ids.astype(np.float32)).numpy(), out.numpy())
    with pytest.raises(TypeError, match="needs integer ids"):
        ours(tf.constant([["a"]]))
    with pytest.raises(ValueError, match="needs its size"):
        Embedding(3, name="no_size")(ids)


def test_functional_model_with_masking_and_config_round_trip():
    inputs = keras.Input(shape=(4,), dtype="int64")
    emb = Embedding(8, input_dim=100, mask_zero=True, embeddings_initializer="glorot_uniform", name="tokens")
    pooled = keras.layers.GlobalAveragePooling1D()(emb(inputs))
    model = keras.Model(inputs, pooled)
    ids = np.array([[5, 6, 0, 0]], np.int64)
    row5, row6 = emb.embeddings.numpy()[[5, 6]]
    np.testing.assert_allclose(model(ids).numpy()[0], (row5 + row6) / 2, atol=1e-6)  # padding masked
    config = emb.get_config()
    clone = Embedding.from_config(config)
    assert (clone.output_dim, clone.input_dim, clone.mask_zero, clone.combiner) == (8, 100, True, None)
    limit = np.sqrt(6 / 108)
    assert initializer_spec(clone.embeddings_initializer, 100, 8) == {
        "distribution": "uniform", "minval": -limit, "maxval": limit, "seed": None,
    }


@pytest.mark.parametrize("mode", ["local", "ps"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("form", ["ragged", "sparse", "dense"])
def test_combiners(mode, combiner, form):
    bags = [[1, 4, 4], [], [2]] if form != "dense" else [[1, 4, 4], [3, 3, 3], [2, 0, 5]]
    if mode == "local":
        layer = Embedding(3, input_dim=10, combiner=combiner, name="bag")
    else:
        layer, _ = ps_backed(3, combiner=combiner, name="bag")
    if form == "ragged":
        inputs = tf.ragged.constant(bags, dtype=tf.int64)
    elif form == "sparse":
        inputs = tf.ragged.constant(bags, dtype=tf.int64).to_sparse()
    else:
        inputs = tf.constant(bags, tf.int64)
    out = layer(inputs, training=True).numpy()
    table = initial_rows(layer.table_info().initializer, np.arange(10), 3)
    expected = []
    for bag in bags:
        total = table[bag].sum(axis=0) if bag else np.zeros(3, np.float32)
        n = len(bag)
        expected.append({"sum": total, "mean": total / max(n, 1), "sqrtn": total / max(np.sqrt(n), 1)}[combiner])
    assert out.shape == (3, 3)
    np.testing.assert_allclose(out, np.array(expected), atol=1e-6)


def test_ps_backed_layer_reads_only_the_batch_rows():
    layer, tables = ps_backed(4, name="items")
    ids = np.array([[10**12, 3], [3, 5]], np.int64)  # no input_dim: any int64 id >= 0
    out = layer(ids, training=True).numpy()
    assert layer.mode == "ps" and layer.weights == []
    table = tables.source.tables["items/embeddings"]
    assert sorted(table.state()[0].tolist()) == [3, 5, 10**12]
    np.testing.assert_array_equal(out, initial_rows(layer.table_info().initializer, ids.ravel(), 4).reshape(2, 2, 4))
    # Without training, unseen ids read as zero rows and create nothing.
    np.testing.assert_array_equal(layer(np.array([[7]], np.int64)).numpy(), 0)
    assert len(table) == 3
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids must be >= 0"):
        layer(np.array([[-1]], np.int64))
    bounded, _ = ps_backed(4, input_dim=10, name="bounded")
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids must be < input_dim=10"):
        bounded(np.array([[10]], np.int64))


def test_frozen_layer_maps_unknown_ids_to_the_default_zero_row():
    ids, rows = np.array([9, 2, 40], np.int64), np.arange(12, dtype=np.float32).reshape(3, 4)
    with use_embedding_backend(EmbeddingTables(FrozenTables(lambda name: (ids, rows)))):
        layer = Embedding(4, name="frozen")
    out = layer(np.array([[2, 40, 3], [9, 0, 2**62]], np.int64)).numpy()
    np.testing.assert_array_equal(out[0], [rows[1], rows[2], np.zeros(4)])
    np.testing.assert_array_equal(out[1], [rows[0], np.zeros(4), np.zeros(4)])
    assert not layer.trainable_weights and [w.path for w in layer.weights] == ["frozen/ids", "frozen/embeddings"]


@pytest.mark.parametrize(
    "initializer, expected",
    [
        ("uniform", {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": None}),
        (keras.initializers.RandomNormal(0.0, 0.01, seed=4), {"distribution": "normal", "mean": 0.0, "stddev": 0.01, "seed": 4}),
        ("truncated_normal", {"distribution": "truncated_normal", "mean": 0.0, "stddev": 0.05, "seed": None}),
        ("zeros", {"distribution": "constant", "value": 0.0, "seed": 0}),
        (keras.initializers.Constant(0.5), {"distribution": "constant", "value": 0.5, "seed": 0}),
    ],
)
def test_initializer_specs(initializer, expected):
    assert initializer_spec(initializer) == expected


def test_unsupported_initializers_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="need `input_dim`"):
        Embedding(4, embeddings_initializer="he_normal")
    with pytest.raises(ValueError, match="Orthogonal is not supported"):
        Embedding(4, input_dim=10, embeddings_initializer="orthogonal")
    with pytest.raises(ValueError, match="combiner"):
        Embedding(4, combiner="max")
    with pytest.raises(ValueError, match="output_dim"):
        Embedding(0)


def test_swap_threshold_flag_default_matches_the_layer_default():
    from elasticdl.config import JobConfig
    from elasticdl.model.embedding.swap import DEFAULT_THRESHOLD_MB, threshold_bytes

    assert JobConfig().training.embedding_swap_threshold_mb == DEFAULT_THRESHOLD_MB == 2.0
    assert threshold_bytes(2.0) == 2 * 1024 * 1024 and threshold_bytes(-1) is None


def test_bounds_arguments_reach_the_table_info_and_the_config():
    from elasticdl.model.embedding.policy import TablePolicy

    layer, tables = ps_backed(4, name="items", admit_min_count=3, ttl_versions=50, max_rows=1000)
    layer(np.array([[1, 2]], np.int64), training=True)
    policy = TablePolicy(admit_min_count=3, ttl_versions=50, max_rows=1000)
    assert layer.table_info().policy == tables.infos["items/embeddings"].policy == policy
    assert Embedding.from_config(layer.get_config()).policy == policy
    # Admission filters new ids: a training lookup reads the zero row and makes no row.
    assert len(tables.source.tables["items/embeddings"]) == 0
    with pytest.raises(ValueError, match=r"`admit_probability` must be a number in \(0, 1\]"):
        Embedding(4, admit_probability=0)
    with pytest.raises(ValueError, match="`max_rows` must be an integer >= 0 and <= 4611686018427387904. Received: max_rows=-1"):
        Embedding(4, max_rows=-1)


def test_the_swap_bounds_its_tables_by_the_flags(caplog):
    from elasticdl.config import JobConfig
    from elasticdl.model.embedding.policy import TablePolicy
    from elasticdl.model.embedding.swap import swap_large_embeddings, swap_policy

    training = JobConfig.from_flags(embedding_admit_min_count=2, embedding_max_rows=500).training
    assert swap_policy(training) == TablePolicy(admit_min_count=2, max_rows=500)
    assert swap_policy(JobConfig().training) == TablePolicy()
    with caplog.at_level("INFO"), use_embedding_backend(EmbeddingTables()), \
            swap_large_embeddings(0, swap_policy(training)):
        layer = keras.layers.Embedding(1000, 8, name="big_bounded")
    assert isinstance(layer, Embedding) and layer.policy == TablePolicy(admit_min_count=2, max_rows=500)
    assert "'big_bounded', its rows live on the parameter servers (admit_min_count=2, max_rows=500)" in caplog.text
