"""elasticdl_preprocessing's layers (the original ElasticDL's import path, our own code): each
against the semantics the original documents, on dense, sparse and ragged inputs, in Keras 3
(this process); tests/test_original_zoo.py runs them in Keras 2 models (tests/zoo/original/dac_ctr)
through training, export and serving."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from elasticdl_preprocessing.layers import ConcatenateWithOffset, Discretization, Hashing, Normalizer


def test_hashing_gives_the_documented_ids():
    # The original's docstring: Hashing(num_bins=3) on A..E gives [[1], [0], [1], [1], [2]].
    out = Hashing(num_bins=3)(np.asarray([["A"], ["B"], ["C"], ["D"], ["E"]]))
    assert out.dtype == tf.int64
    assert out.numpy().tolist() == [[1], [0], [1], [1], [2]]


def test_hashing_hashes_integers_as_their_decimal_strings():
    layer = Hashing(num_bins=1000)
    ints = layer(tf.constant([[7, -12], [123456789012, 0]], tf.int64)).numpy()
    strings = layer(tf.constant([["7", "-12"], ["123456789012", "0"]])).numpy()
    assert ints.tolist() == strings.tolist()
    assert layer(tf.constant([[7]], tf.int32)).numpy().tolist() == [[ints[0, 0]]]


def test_hashing_keeps_sparse_and_ragged_structure():
    layer = Hashing(num_bins=3)
    ragged = layer(tf.ragged.constant([["A", "B"], ["E"]]))
    assert isinstance(ragged, tf.RaggedTensor) and ragged.to_list() == [[1, 0], [2]]
    sparse = layer(tf.SparseTensor(indices=[[0, 1], [2, 0]], values=["D", "E"], dense_shape=[3, 2]))
    assert isinstance(sparse, tf.SparseTensor)
    assert sparse.indices.numpy().tolist() == [[0, 1], [2, 0]] and sparse.values.numpy().tolist() == [1, 2]


@pytest.mark.parametrize("num_bins", [0, -3, None])
def test_hashing_refuses_a_bin_count_that_is_not_positive(num_bins):
    with pytest.raises(ValueError, match="num_bins"):
        Hashing(num_bins=num_bins)


# The dac_ctr zoo's I2 boundaries: negative, a repeated boundary, integers fed to float bins.
DAC_BINS = [-1.0, 0.0, 1.0, 1.0, 3.0, 8.0, 23.0, 56.0, 184.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
def test_discretization_is_numpy_digitize(dtype):
    values = np.random.default_rng(0).uniform(-5, 300, size=(64, 3))
    values = np.concatenate([values, np.asarray(DAC_BINS * 3).reshape(-1, 3)]).astype(dtype)  # the boundaries themselves
    out = Discretization(bins=DAC_BINS)(tf.constant(values))
    assert out.dtype == tf.int64
    np.testing.assert_array_equal(out.numpy(), np.digitize(values, DAC_BINS))


def test_discretization_bins_include_the_left_boundary():
    # The documented example: bins=[0, 1, 2] make (-inf, 0), [0, 1), [1, 2), [2, inf).
    out = Discretization(bins=[0.0, 1.0, 2.0])(tf.constant([[-0.5, 0.0, 0.99, 1.0, 2.0, 7.0]]))
    assert out.numpy().tolist() == [[0, 1, 1, 2, 3, 3]]
    assert Discretization(bins=[0.0, 1.0, 2.0]).num_bins() == 4


def test_discretization_keeps_sparse_and_ragged_structure():
    layer = Discretization(bins=[0.0, 10.0])
    ragged = layer(tf.ragged.constant([[-1.0, 5.0], [11.0]]))
    assert isinstance(ragged, tf.RaggedTensor) and ragged.to_list() == [[0, 1], [2]]
    sparse = layer(tf.SparseTensor(indices=[[0, 0], [1, 1]], values=[12.0, 3.0], dense_shape=[2, 2]))
    assert isinstance(sparse, tf.SparseTensor) and sparse.values.numpy().tolist() == [2, 1]


def test_discretization_refuses_unsorted_bins_and_strings():
    with pytest.raises(ValueError, match="sorted"):
        Discretization(bins=[1.0, 0.0])
    with pytest.raises(TypeError, match="to_number"):
        Discretization(bins=[0.0])(tf.constant([["1"]]))


def test_normalizer_subtracts_and_divides_in_float32():
    # The documented example: subtractor 1, divisor 2 on [3, 5, 7] gives [1, 2, 3].
    out = Normalizer(subtractor=1.0, divisor=2.0)(np.asarray([[3.0], [5.0], [7.0]]))
    assert out.dtype == tf.float32 and out.numpy().tolist() == [[1.0], [2.0], [3.0]]
    ints = Normalizer(subtractor=105.85, divisor=391.73)(tf.constant([[0], [500]], tf.int64))  # dac_ctr's I2
    np.testing.assert_allclose(ints.numpy(), (np.array([[0], [500]]) - 105.85) / 391.73, rtol=1e-6)


def test_normalizer_keeps_sparse_and_ragged_structure():
    layer = Normalizer(subtractor=1.0, divisor=4.0)
    assert layer(tf.ragged.constant([[5.0, 9.0], [1.0]])).to_list() == [[1.0, 2.0], [0.0]]
    sparse = layer(tf.SparseTensor(indices=[[1, 0]], values=[13.0], dense_shape=[2, 1]))
    assert isinstance(sparse, tf.SparseTensor) and sparse.values.numpy().tolist() == [3.0]


def test_normalizer_refuses_a_zero_divisor():
    with pytest.raises(ValueError, match="divisor"):
        Normalizer(subtractor=1.0, divisor=0)


def test_concatenate_with_offset_shifts_each_input_by_its_offset():
    # The documented example: [[1]]*3 and [[2]]*3 with offsets [0, 10] give [[1, 12]]*3.
    out = ConcatenateWithOffset(offsets=[0, 10], axis=1)([tf.constant([[1], [1], [1]]), tf.constant([[2], [2], [2]])])
    assert out.numpy().tolist() == [[1, 12]] * 3
    ids = ConcatenateWithOffset(offsets=[0, 5, 9])([tf.constant([[4]], tf.int64)] * 3)
    assert ids.dtype == tf.int64 and ids.numpy().tolist() == [[4, 9, 13]]


def test_concatenate_with_offset_on_sparse_and_ragged_inputs():
    a = tf.SparseTensor(indices=[[0, 0]], values=tf.constant([1], tf.int64), dense_shape=[2, 1])
    b = tf.SparseTensor(indices=[[1, 0]], values=tf.constant([2], tf.int64), dense_shape=[2, 1])
    sparse = ConcatenateWithOffset(offsets=[0, 10], axis=1)([a, b])
    assert isinstance(sparse, tf.SparseTensor)
    assert tf.sparse.to_dense(sparse).numpy().tolist() == [[1, 0], [0, 12]]
    ragged = ConcatenateWithOffset(offsets=[0, 10], axis=1)([tf.ragged.constant([[1, 2], [3]]),
                                                             tf.ragged.constant([[4], []])])
    assert ragged.to_list() == [[1, 2, 14], [3]]


def test_concatenate_with_offset_needs_one_offset_per_input():
    with pytest.raises(ValueError, match="one offset per input"):
        ConcatenateWithOffset(offsets=[0])([tf.constant([[1]]), tf.constant([[2]])])


@pytest.mark.parametrize("layer", [Hashing(num_bins=7), Discretization(bins=[0.0, 1.0]),
                                   Normalizer(subtractor=2.0, divisor=3.0), ConcatenateWithOffset(offsets=[0, 3], axis=1)],
                         ids=lambda layer: type(layer).__name__)
def test_config_round_trips(layer):
    again = type(layer).from_config(layer.get_config())
    assert again.get_config() == layer.get_config()


def test_a_model_of_the_four_layers_exports_and_serves_what_it_computes(tmp_path):
    """The dac_ctr transform's shape (standardize I, bucketize I, hash C, one id space), in Keras 3,
    through ElasticDL's export: the SavedModel serves the ids and values the model computed."""
    from elasticdl.model.export import export_saved_model

    inputs = {"I1": tf.keras.Input(shape=(1,), dtype="int64", name="I1"),
              "C1": tf.keras.Input(shape=(1,), dtype="string", name="C1")}
    discretize, hashing = Discretization(bins=[0.0, 5.0]), Hashing(num_bins=11)
    ids = ConcatenateWithOffset([0, discretize.num_bins()])([discretize(inputs["I1"]), hashing(inputs["C1"])])
    model = tf.keras.Model(inputs, {"standardized": Normalizer(subtractor=3.0, divisor=2.0)(inputs["I1"]), "ids": ids})
    batch = {"I1": tf.constant([[-1], [5], [9]], tf.int64), "C1": tf.constant([["a"], ["b"], ["c"]])}
    expected = model(batch)
    assert expected["ids"].numpy()[:, 0].tolist() == [0, 2, 2]
    assert set(expected["ids"].numpy()[:, 1]) <= set(range(3, 14))
    export_saved_model(model, str(tmp_path / "model"))
    served = tf.saved_model.load(str(tmp_path / "model")).signatures["serving_default"](**batch)
    np.testing.assert_array_equal(served["ids"].numpy(), expected["ids"].numpy())
    np.testing.assert_allclose(served["standardized"].numpy(), [[-2.0], [1.0], [3.0]])
