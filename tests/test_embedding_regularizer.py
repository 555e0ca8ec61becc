"""L1/L2 ``embeddings_regularizer`` on parameter-server tables: the swap keeps it, and one step
updates the touched rows exactly as Keras's dense update does (docs/embeddings.md, "Regularizers")."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl.layers import Embedding
from elasticdl.model.embedding.backends import EmbeddingTables, use_embedding_backend
from elasticdl.model.embedding.regularizer import RegularizerError, RowRegularizer
from elasticdl.model.embedding.swap import swap_large_embeddings
from elasticdl.model.embedding.table import EmbeddingTable, initial_rows
from elasticdl.model.optimizers import make_optimizer, optimizer_spec_from_keras
from elasticdl.model.spec import load_model_spec
from elasticdl.model.trainer import Trainer

# The keras-io collaborative-filtering model, as the benchmark runs it.
ZOO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "model_zoo")
REGULARIZED = ("users", "movies")


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(ZOO, "collab.recommender.custom_model")


def test_row_regularizer_reads_keras_l1_l2_and_refuses_others():
    assert RowRegularizer.from_keras(None) is None
    assert RowRegularizer.from_keras("l2") == RowRegularizer(l2=0.01)
    assert RowRegularizer.from_keras(keras.regularizers.L1(0.5)) == RowRegularizer(l1=0.5)
    assert RowRegularizer.from_keras(keras.regularizers.L1L2(l1=0.1, l2=0.2)) == RowRegularizer(0.1, 0.2)

    class Doubled(keras.regularizers.L2):  # a subclass may compute anything: not trusted
        def __call__(self, x):
            return 2 * super().__call__(x)

    for other in (Doubled(0.1), keras.regularizers.OrthogonalRegularizer(), "not_a_regularizer"):
        with pytest.raises(RegularizerError, match="keras.regularizers.L1, L2 or L1L2|use 'l1', 'l2'"):
            RowRegularizer.from_keras(other)
    rows = tf.constant([[1.0, -2.0], [0.5, 0.0]])
    assert float(RowRegularizer(l1=0.1, l2=0.2).penalty(rows)) == pytest.approx(0.1 * 3.5 + 0.2 * 5.25)


@pytest.mark.parametrize("factors", [{"l2": 0.05}, {"l2": 0.0, "l1": 0.05}, {"l2": 0.03, "l1": 0.02}],
                         ids=["l2", "l1", "l1l2"])
def test_one_step_updates_touched_rows_as_keras_dense_update(spec, factors):
    """The row gradients (data + regularizer) of a swapped table, applied by the PS's SGD, equal
    Keras's dense SGD step on the whole regularized table, restricted to the rows the batch
    touched; the loss adds the touched rows' penalty where Keras adds the whole table's."""
    params = {"num_users": 30, "num_movies": 20, "embedding_size": 5, **factors}
    features = tf.constant([[3, 7], [3, 1], [12, 7], [29, 19]], tf.int64)  # duplicate ids 3 and 7
    labels = tf.constant([[1.0], [0.0], [0.5], [1.0]])
    trainer = Trainer(spec, params, embedding_swap_threshold_mb=0)
    trainer.ensure_built(features)
    layers = {name: trainer.model.get_layer(name) for name in REGULARIZED}
    assert all(isinstance(layer, Embedding) and layer.mode == "ps" for layer in layers.values())
    loss, grads = trainer.compute_gradients(features, labels)

    reference = spec.build_model(params)  # outside a Trainer: plain Keras, whole tables
    reference(features)
    infos = trainer.embeddings.infos
    for var in reference.trainable_variables:  # the Keras tables start from the PS's rows
        table = next(n for n in infos if n.endswith(var.path.split("/", 1)[1]))
        var.assign(initial_rows(infos[table].initializer, np.arange(var.shape[0], dtype=np.int64), var.shape[1]))
    with tf.GradientTape() as tape:
        data_loss = trainer.spec.loss(labels, reference(features, training=True))
        keras_loss = data_loss + tf.add_n(reference.losses)
    dense = dict(zip([v.path for v in reference.trainable_variables],
                     tape.gradient(keras_loss, reference.trainable_variables)))

    lr = 0.5
    regularizer = RowRegularizer.from_keras(keras.regularizers.L1L2(**factors))
    touched_penalty = 0.0
    for column, name in enumerate(REGULARIZED):
        table_name = layers[name].table_name
        rows = grads[table_name]
        touched = np.unique(features.numpy()[:, column])
        assert sorted(rows.ids.tolist()) == touched.tolist()
        var = next(v for v in reference.trainable_variables if v.path == f"recommender/{name}/embeddings")
        before = var.numpy()
        keras_step = before - lr * tf.convert_to_tensor(dense[var.path]).numpy()
        np.testing.assert_allclose(rows.values, (keras_step - before)[rows.ids] / -lr, atol=1e-6)
        ps = EmbeddingTable(infos[table_name], make_optimizer(optimizer_spec_from_keras(keras.optimizers.SGD(lr))))
        ps.apply(rows, step=1, learning_rate=None)
        np.testing.assert_allclose(ps.lookup(touched, create=False), keras_step[touched], atol=1e-6)
        # What differs: Keras also shrinks every row the batch did not touch; the PS leaves them.
        untouched = np.setdiff1d(np.arange(before.shape[0]), touched)
        shrink = 2 * regularizer.l2 * before[untouched] + regularizer.l1 * np.sign(before[untouched])
        np.testing.assert_allclose(keras_step[untouched], before[untouched] - lr * shrink, atol=1e-6)
        assert not np.allclose(keras_step[untouched], before[untouched])
        touched_penalty += float(regularizer.penalty(before[touched]))
    np.testing.assert_allclose(loss, float(data_loss) + touched_penalty, rtol=1e-5)
    assert loss < float(keras_loss)


def test_swap_accepts_regularized_embedding_and_logs_it(caplog):
    with caplog.at_level(logging.INFO), swap_large_embeddings(0), use_embedding_backend(EmbeddingTables()):
        swapped = keras.layers.Embedding(1000, 8, embeddings_regularizer=keras.regularizers.L2(1e-6), name="reg")
        other = keras.layers.Embedding(1000, 8, embeddings_regularizer=keras.regularizers.OrthogonalRegularizer(),
                                       name="ortho")
        constrained = keras.layers.Embedding(1000, 8, embeddings_constraint="non_neg", name="constrained")
    assert isinstance(swapped, Embedding) and swapped._regularizer == RowRegularizer(l2=1e-6)
    assert "swapped for elasticdl.layers.Embedding 'reg'" in caplog.text
    assert "regularizer l2=1e-06 on the rows each batch touches" in caplog.text
    assert type(other) is keras.layers.Embedding and type(constrained) is keras.layers.Embedding
    # The warning says what to change, not only why.
    assert "Use keras.regularizers.L1, L2 or L1L2" in caplog.text
    assert "to swap it, remove `embeddings_constraint`" in caplog.text
    assert "raise --embedding_swap_threshold_mb above 0.03" in caplog.text


def test_local_layer_penalizes_the_whole_table_as_keras_does():
    """Without parameter servers the layer is a Keras table with the Keras regularizer."""
    layer = Embedding(4, input_dim=10, embeddings_regularizer="l1")
    layer(tf.constant([1, 2], tf.int64))
    table = layer.embeddings.numpy()
    np.testing.assert_allclose(float(tf.add_n(layer.losses)), 0.01 * np.abs(table).sum(), rtol=1e-5)
    config = layer.get_config()
    restored = RowRegularizer.from_keras(keras.regularizers.deserialize(config["embeddings_regularizer"]))
    assert (restored.l1, restored.l2) == (pytest.approx(0.01), 0.0)


def test_keras2_layer_penalizes_touched_rows_and_local_tables():
    """The Keras 2 (tf_keras) layer shares the lookup: the same penalty and row gradient."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "keras2_regularizer_check.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_USE_LEGACY_KERAS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["penalty"] == pytest.approx(out["expected_penalty"], rel=1e-5) and out["penalty"] > 0
    assert out["gradient_error"] < 1e-6
    assert out["local_penalty"] == pytest.approx(out["expected_local"], rel=1e-5)
    assert out["restored_l1"] == pytest.approx(0.01)  # get_config keeps the regularizer
