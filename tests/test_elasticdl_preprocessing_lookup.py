"""elasticdl_preprocessing's ToSparse, IndexLookup and SparseEmbedding (the original's census
wide & deep layers), against the semantics the original documents, in Keras 3 (this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_preprocessing.layers import ConcatenateWithOffset, IndexLookup, SparseEmbedding, ToSparse


def test_to_sparse_drops_the_padding_cells():
    # The documented example: "" cells dropped, the dense shape kept.
    out = ToSparse()(tf.constant([["A", ""], ["B", "C"]]))
    assert isinstance(out, tf.SparseTensor)
    assert out.indices.numpy().tolist() == [[0, 0], [1, 0], [1, 1]]
    assert out.values.numpy().tolist() == [b"A", b"B", b"C"] and out.dense_shape.numpy().tolist() == [2, 2]
    ints = ToSparse()(tf.constant([[0, -1], [-1, 5]], tf.int64))  # -1 is padding, 0 an id
    assert ints.indices.numpy().tolist() == [[0, 0], [1, 1]] and ints.values.numpy().tolist() == [0, 5]
    assert ToSparse(ignore_value=7)(tf.constant([[7, 8]])).values.numpy().tolist() == [8]
    floats = ToSparse()(tf.constant([[0.0, 1.5]]))  # no padding value for floats: every cell kept
    assert floats.values.numpy().tolist() == [0.0, 1.5]


def test_to_sparse_returns_a_sparse_input_as_it_is():
    sparse = tf.SparseTensor(indices=[[0, 1]], values=["x"], dense_shape=[1, 2])
    assert ToSparse()(sparse) is sparse


def test_index_lookup_gives_the_documented_ids():
    # The documented example: A, B, C at 0, 1, 2; D and E out of the vocabulary, at 3.
    out = IndexLookup(vocabulary=["A", "B", "C"])(np.asarray([["A"], ["B"], ["C"], ["D"], ["E"]]))
    assert out.dtype == tf.int64 and out.numpy().tolist() == [[0], [1], [2], [3], [3]]
    assert IndexLookup(vocabulary=["A"], num_oov_tokens=0)(tf.constant([["A", "Z"]])).numpy().tolist() == [[0, -1]]
    oov = IndexLookup(vocabulary=["A"], num_oov_tokens=4)(tf.constant([[f"t{i}" for i in range(50)]])).numpy()
    assert set(oov.reshape(-1)) <= {1, 2, 3, 4} and len(set(oov.reshape(-1))) > 1  # hashed into the 4 OOV ids


def test_index_lookup_reads_a_vocabulary_file_and_keeps_structure(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("Private\nSelf-emp\n\n")
    layer = IndexLookup(vocabulary=str(path))
    assert layer.vocab_size() == 2
    sparse = layer(tf.SparseTensor(indices=[[0, 0], [1, 1]], values=["Self-emp", "Never"], dense_shape=[2, 2]))
    assert isinstance(sparse, tf.SparseTensor) and sparse.values.numpy().tolist() == [1, 2]
    assert layer(tf.ragged.constant([["Private"], ["Self-emp", "Private"]])).to_list() == [[0], [1, 0]]


def test_index_lookup_refuses_a_repeated_or_empty_vocabulary():
    with pytest.raises(ValueError, match="repeats"):
        IndexLookup(vocabulary=["A", "B", "A"])
    with pytest.raises(ValueError, match="at least one term"):
        IndexLookup(vocabulary=[])


@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_sparse_embedding_combines_each_examples_rows(combiner):
    layer = SparseEmbedding(input_dim=6, output_dim=3, combiner=combiner)
    ids = tf.SparseTensor(indices=[[0, 0], [0, 1], [2, 0]], values=tf.constant([1, 4, 5], tf.int64), dense_shape=[3, 2])
    out = layer(ids).numpy()
    table = layer.embeddings.numpy()
    scale = {"sum": 1.0, "mean": 0.5, "sqrtn": 1 / np.sqrt(2)}[combiner]
    np.testing.assert_allclose(out[0], (table[1] + table[4]) * scale, rtol=1e-6)
    np.testing.assert_allclose(out[1], np.zeros(3))  # no ids: zeros
    np.testing.assert_allclose(out[2], table[5], rtol=1e-6)


def test_sparse_embedding_takes_dense_ids_with_zero_as_padding():
    layer = SparseEmbedding(input_dim=6, output_dim=2, combiner="sum")
    out = layer(tf.constant([[3, 0], [0, 0]], tf.int64)).numpy()
    np.testing.assert_allclose(out, [layer.embeddings.numpy()[3], [0.0, 0.0]], rtol=1e-6)


def test_sparse_embedding_refuses_an_unknown_combiner():
    with pytest.raises(ValueError, match="combiner"):
        SparseEmbedding(input_dim=3, output_dim=2, combiner="max")


def test_the_census_chain_trains_exports_and_serves(tmp_path):
    """ToSparse, IndexLookup and ConcatenateWithOffset into a SparseEmbedding, as the original's
    census wide & deep built them: the embedding gets a gradient, and the SavedModel (its lookup
    table included) serves what the model computed."""
    from elasticdl.model.export import export_saved_model

    inputs = {"workclass": tf.keras.Input(shape=(1,), dtype="string", name="workclass"),
              "sex": tf.keras.Input(shape=(1,), dtype="string", name="sex")}
    work = IndexLookup(["Private", "Gov"])(ToSparse()(inputs["workclass"]))
    sex = IndexLookup(["F", "M"])(ToSparse()(inputs["sex"]))
    ids = ConcatenateWithOffset([0, 3], axis=1)([work, sex])
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(SparseEmbedding(input_dim=6, output_dim=4)(ids)))
    batch = {"workclass": tf.constant([["Gov"], ["Other"]]), "sex": tf.constant([["M"], [""]])}
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(batch))
    grads = tape.gradient(loss, model.trainable_variables)
    assert all(g is not None for g in grads)
    export_saved_model(model, str(tmp_path / "model"))
    served = tf.saved_model.load(str(tmp_path / "model")).signatures["serving_default"](**batch)
    np.testing.assert_allclose(next(iter(served.values())).numpy(), model(batch).numpy(), rtol=1e-5)


KERAS2_MODEL = r"""
import json
import tempfile

import numpy as np
import tensorflow as tf
from elasticdl_preprocessing.layers import (ConcatenateWithOffset, Discretization, Hashing, IndexLookup, Normalizer,
                                            SparseEmbedding, ToSparse)
from elasticdl.model.export import export_saved_model, record_input_signature

inputs = {"I1": tf.keras.Input(shape=(1,), dtype=tf.int64, name="I1"),
          "C1": tf.keras.Input(shape=(1,), dtype=tf.string, name="C1"),
          "sex": tf.keras.Input(shape=(1,), dtype=tf.string, name="sex")}
dense_ids = ConcatenateWithOffset([0, 3])([Discretization([0.0, 5.0])(inputs["I1"]), Hashing(7)(inputs["C1"])])
sparse_ids = ConcatenateWithOffset([0, 3], axis=1)([IndexLookup(["F", "M"])(ToSparse()(inputs["sex"])),
                                                   Hashing(5)(ToSparse()(inputs["C1"]))])
x = tf.keras.layers.Concatenate()([Normalizer(3.0, 2.0)(inputs["I1"]),
                                   tf.keras.layers.Flatten()(tf.keras.layers.Embedding(10, 2)(dense_ids)),
                                   SparseEmbedding(8, 2)(sparse_ids)])
model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(x))
batch = {"I1": tf.constant([[-1], [9]], tf.int64), "C1": tf.constant([["a"], [""]]), "sex": tf.constant([["M"], ["X"]])}
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model(batch))
grads = tape.gradient(loss, model.trainable_variables)
out = tempfile.mkdtemp()
record_input_signature(model, batch)  # as the Trainer does on its first batch
export_saved_model(model, out)
loaded = tf.saved_model.load(out)
served = next(iter(loaded.signatures["serving_default"](**batch).values()))
print(json.dumps({"keras": type(model).__module__.split(".")[0], "grads": all(g is not None for g in grads),
                  "served_as_computed": bool(np.allclose(served.numpy(), model(batch).numpy(), rtol=1e-5)),
                  "hash_doc": Hashing(3)(np.asarray([["A"], ["B"], ["C"], ["D"], ["E"]])).numpy().tolist()}))
"""


def test_every_layer_in_a_keras2_model_trains_exports_and_serves():
    """The seven layers in one tf_keras model (the dac_ctr chain and the census chain): they
    subclass tf_keras's Layer there, every variable gets a gradient, and ElasticDL's Keras 2
    export serves what the model computed (the lookup tables saved with it)."""
    pytest.importorskip("tf_keras")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": repo, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-c", KERAS2_MODEL], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "keras": "tf_keras", "grads": True, "served_as_computed": True, "hash_doc": [[1], [0], [1], [1], [2]]}
