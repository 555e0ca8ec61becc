"""A model whose class overrides train_step (compute_loss, test_step, predict_step) is refused at
submit with the reason and what to do: ElasticDL never calls those hooks."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

from elasticdl.config import JobConfig
from elasticdl.master.preflight import check_job
from elasticdl.model.spec import ModelSpecError
from elasticdl.model.step_overrides import overridden_hooks
from tests.test_sample_weight import _digits_like

MODULE = '''
import keras
import tensorflow as tf

from weightzoo.digits_weighted import optimizer  # noqa: F401

_FEATURES = {"image": tf.io.FixedLenFeature([64], tf.float32), "label": tf.io.FixedLenFeature([1], tf.int64)}


class Stepped(keras.Model):
    """A model.fit user's model: its own train_step (e.g. a gradient penalty)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)

    def call(self, x):
        return self.dense(x)


class Custom(Stepped):
    def {hook}(self, *args, **kwargs):
        raise AssertionError("never called by ElasticDL")


def custom_model():
    return Custom()


def plain_model():
    return Stepped()


def loss(labels, predictions):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        return example["image"], example["label"]

    return dataset.map(parse)


def eval_metrics_fn():
    return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}
'''

_ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def _config(tmp_path, hook: str, command: str, model: str = "custom_model") -> JobConfig:
    import sys

    package = tmp_path / f"stepzoo_{hook}"
    package.mkdir(exist_ok=True)
    (package / "m.py").write_text(MODULE.replace("{hook}", hook))
    if _ZOO not in sys.path:
        sys.path.append(_ZOO)  # weightzoo, for the optimizer
    data = _digits_like(tmp_path / "d.tfrecord")
    flag = {"train": "training_data", "evaluate": "validation_data", "predict": "prediction_data"}[command]
    # The checkpoint is resolved after the model is checked: none is needed to be refused.
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    checkpoint = {} if command == "train" else {"checkpoint_dir_for_init": str(tmp_path / "ckpt")}
    return JobConfig.from_flags(model_zoo=str(tmp_path), model_def=f"stepzoo_{hook}.m.{model}",
                                minibatch_size=8, **{flag: data}, **checkpoint)


@pytest.mark.parametrize("hook, command, says", [
    ("train_step", "train", "a worker computes the gradients of loss(labels, model(features, training=True)) "
                            "plus model.losses, and the parameter servers apply them with optimizer()"),
    ("compute_loss", "train", "the loss is the module's loss(labels, predictions) plus model.losses"),
    ("test_step", "evaluate", "evaluation computes eval_metrics_fn()'s metrics"),
    ("predict_step", "predict", "prediction writes model(features, training=False)"),
])
def test_an_overridden_hook_is_refused_at_submit_with_the_reason_and_the_fix(tmp_path, hook, command, says):
    with pytest.raises(ModelSpecError) as info:
        check_job(_config(tmp_path, hook, command), command)
    message = str(info.value)
    assert message.startswith(f"{tmp_path}/stepzoo_{hook}/m.py: custom_model() returns a Custom, whose class "
                              f"Custom overrides {hook}(), which ElasticDL does not run: {says}")
    assert "silently lost" in message


def test_a_subclassed_model_without_overrides_passes(tmp_path):
    check_job(_config(tmp_path, "train_step", "train", model="plain_model"))


def test_evaluation_during_training_refuses_a_test_step_too(tmp_path):
    config = _config(tmp_path, "test_step", "train")
    config = config.replace(validation_data=config.data.training_data)
    with pytest.raises(ModelSpecError, match=r"overrides test_step\(\)"):
        check_job(config)


def test_functional_and_sequential_models_override_nothing():
    import keras

    inputs = keras.Input((3,))
    for model in (keras.Model(inputs, keras.layers.Dense(1)(inputs)), keras.Sequential([keras.layers.Dense(1)])):
        assert [overridden_hooks(model, c) for c in ("train", "evaluate", "predict")] == [[], [], []]
