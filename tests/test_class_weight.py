"""Class weights as model.fit(class_weight=...) takes them: --class_weight or the module's
class_weight(), checked at submit, turned into each training example's sample weight."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from elasticdl.config import ConfigError, JobConfig
from elasticdl.config.class_weight import parse_class_weight
from elasticdl.master.preflight import check_job
from elasticdl.mode import Mode
from elasticdl.model.class_weight import add_class_weights
from elasticdl.model.spec import DatasetMetadata, ModelSpecError, load_model_spec
from elasticdl.model.trainer import make_dataset
from tests.test_sample_weight import _digits_like

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


@pytest.mark.parametrize("text", ["0:1.0,1:5.0", " 0 : 1, 1:5 ", '{"0": 1.0, "1": 5.0}', '{"1": 5, "0": 1}'])
def test_the_flag_takes_pairs_or_json(text):
    assert parse_class_weight(text) == {0: 1.0, 1: 5.0}
    config = JobConfig.from_flags(class_weight=text)
    assert config.training.class_weight == {0: 1.0, 1: 5.0}
    assert JobConfig.from_json(config.to_json()).training.class_weight == {0: 1.0, 1: 5.0}
    assert JobConfig.from_flags(class_weight={0: 1, 1: 5.0}).training.class_weight == {0: 1.0, 1: 5.0}
    assert JobConfig.from_flags().training.class_weight == {}


@pytest.mark.parametrize("text, message", [
    ("0:1.0,1", "--class_weight must look like 0:1.0,1:5.0 or {\"0\": 1.0, \"1\": 5.0}. Cannot parse '1'"),
    ("0:1.0,1:heavy", "Cannot parse '1:heavy'"),
    ("a:1.0", "class ids are whole numbers from 0 (the labels' class indices)"),
    ("-1:2.0", "Received the key '-1'"),
    ("0:-2", "the weight of class 0 must be a finite number, 0 or more. Received: -2.0"),
    ("0:nan", "the weight of class 0 must be a finite number"),
    ("0:1,0:2", "class 0 is given twice"),
    ('{"0": 1.0,', "--class_weight is not valid JSON"),
    ('{"0": "x"}', "the weight of class 0 must be a finite number, 0 or more. Received: 'x'"),
])
def test_a_bad_flag_is_refused_naming_it_and_the_form(text, message):
    with pytest.raises(ConfigError) as info:
        JobConfig.from_flags(class_weight=text)
    assert message in str(info.value) and "--class_weight" in str(info.value)


def _keras_weights(features, labels, class_weight):
    """Keras's own class_weight -> sample_weight, on a batch (model.fit's data adapter)."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

    return make_class_weight_map_fn(class_weight)(features, labels)[2].numpy()


@pytest.mark.parametrize("labels", [
    np.array([0, 1, 2, 1, 0, 2, 2]),  # class ids
    np.array([[0], [1], [2], [1], [0], [2], [2]]),  # class ids of shape (1,), as digits' labels
    np.eye(3, dtype=np.float32)[[0, 1, 2, 1, 0, 2, 2]],  # one-hot
    np.array([[0.1, 0.7, 0.2], [0.8, 0.1, 0.1], [0.2, 0.2, 0.6], [0.3, 0.6, 0.1]], np.float32),  # probabilities
])
def test_each_example_weighs_its_class_weight_as_keras_computes_it(labels):
    class_weight = {0: 0.5, 1: 4.0, 2: 2.0}
    features = np.zeros((len(labels), 2), np.float32)
    dataset = add_class_weights(tf.data.Dataset.from_tensor_slices((features, labels)), class_weight, "m.py")
    _, _, weights = next(iter(dataset.batch(len(labels))))
    np.testing.assert_array_equal(weights.numpy(), _keras_weights(features, tf.constant(labels), class_weight))


def test_a_class_the_dict_does_not_name_weighs_1():
    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((4, 1)), np.array([0, 1, 2, 7])))
    _, _, weights = next(iter(add_class_weights(dataset, {0: 3.0, 2: 0.0}, "m.py").batch(4)))
    np.testing.assert_array_equal(weights.numpy(), [3.0, 1.0, 0.0, 1.0])


def test_the_module_function_gives_the_weights_and_the_flag_overrides_it():
    assert load_model_spec(ZOO, "weightzoo.nines_weighted.custom_model").class_weight == {0: 1.0, 1: 9.0}
    assert load_model_spec(ZOO, "weightzoo.nines.custom_model").class_weight == {}
    spec = load_model_spec(ZOO, "weightzoo.nines_weighted.custom_model", class_weight={1: 3.0})
    assert spec.class_weight == {1: 3.0}


def test_a_module_function_returning_no_dict_is_refused_naming_it(tmp_path):
    package = tmp_path / "cwzoo_bad"
    package.mkdir()
    (package / "m.py").write_text(
        "from weightzoo.nines import custom_model, dataset_fn, loss, optimizer  # noqa: F401\n\n\n"
        "def class_weight():\n    return [1.0, 9.0]\n"
    )
    import sys

    sys.path.append(ZOO)
    try:
        with pytest.raises(ModelSpecError, match=r"m.py: class_weight\(\) must be a dict \{class id: weight\}"):
            load_model_spec(str(tmp_path), "cwzoo_bad.m.custom_model")
    finally:
        sys.path.remove(ZOO)
        sys.modules.pop("cwzoo_bad.m", None)
        sys.modules.pop("cwzoo_bad", None)


def test_only_training_examples_are_weighted(tmp_path):
    data = _digits_like(tmp_path / "d.tfrecord")
    records = [r for r in tf.data.TFRecordDataset(data).as_numpy_iterator()][:8]
    spec = load_model_spec(ZOO, "weightzoo.nines_weighted.custom_model")
    metadata = DatasetMetadata("tfrecord")
    train = next(iter(make_dataset(spec, records, Mode.TRAINING, metadata, 8)))
    evaluation = next(iter(make_dataset(spec, records, Mode.EVALUATION, metadata, 8)))
    np.testing.assert_array_equal(train[2].numpy(), np.where(train[1].numpy()[:, 0] == 1, 9.0, 1.0))
    assert len(evaluation) == 2  # as model.fit's validation_data: not weighted by class_weight


def test_class_weights_with_a_dataset_fn_that_yields_weights_are_refused_at_submit(tmp_path):
    data = _digits_like(tmp_path / "d.tfrecord")
    config = JobConfig.from_flags(model_zoo=ZOO, model_def="weightzoo.digits_weighted.custom_model",
                                  training_data=data, minibatch_size=8, class_weight="0:1,1:2")
    with pytest.raises(ModelSpecError) as info:
        check_job(config)
    assert "digits_weighted.py: class weights (--class_weight or class_weight()) make each example's sample " \
           "weight, and dataset_fn yields 3 elements per example" in str(info.value)


def test_class_weights_with_labels_per_output_are_refused():
    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((2, 1)), {"a": np.array([0, 1]), "b": np.array([1, 0])}))
    with pytest.raises(ModelSpecError, match="need one label tensor per example \\(a single output\\)"):
        add_class_weights(dataset, {0: 1.0}, "m.py")
