"""Preflight on the first batch: bad records in it, a loss or gradients that are not finite,
a loss that broadcasts the labels against the predictions, and a model-zoo module whose
custom_model raises or whose dataset_fn batches: each a clear error before any process
starts (the data and worker sides are in test_bad_records.py)."""

from __future__ import annotations

import itertools
import os
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf
from zoo_helpers import restore_import_state

from elasticdl.config import JobConfig
from elasticdl.data.errors import BadRecordError
from elasticdl.data.tfrecord import write_records
from elasticdl.master.preflight import check_job
from elasticdl.model.spec import ModelSpecError

SECTIONS = {
    "prologue": """
        import keras
        import tensorflow as tf

        _FEATURES = {"x": tf.io.FixedLenFeature([4], tf.float32), "y": tf.io.FixedLenFeature([1], tf.int64)}
    """,
    "custom_model": """
        def custom_model(units=3):
            inputs = keras.Input(shape=(4,), name="x")
            return keras.Model(inputs, keras.layers.Dense(units, name="logits")(inputs))
    """,
    "loss": """
        def loss(labels, predictions):
            labels = tf.reshape(labels, [-1])
            return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))
    """,
    "optimizer": """
        def optimizer(lr=0.1):
            return keras.optimizers.SGD(learning_rate=lr)
    """,
    "dataset_fn": """
        def dataset_fn(dataset, mode, metadata):
            def parse(record):
                example = tf.io.parse_single_example(record, _FEATURES)
                return example["x"], example["y"]
            return dataset.map(parse)
    """,
}

_counter = itertools.count()


_restore_import_state = restore_import_state("preflightzoo_")


def example(i: int, label: int | None = None, x=None) -> bytes:
    feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x or [i / 10, 1.0, -1.0, 0.5]))}
    if label != -1:
        feature["y"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3 if label is None else label]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def data(tmp_path, records=None) -> str:
    path = tmp_path / f"data-{next(_counter)}.tfrecord"
    write_records(path, records if records is not None else [example(i) for i in range(12)])
    return str(path)


def config(tmp_path, data_file: str, max_bad_records: int = 0, **replace: str) -> tuple[JobConfig, str]:
    package = f"preflightzoo_{os.getpid()}_{next(_counter)}"
    zoo = tmp_path / "zoo"
    (zoo / package).mkdir(parents=True)
    (zoo / package / "__init__.py").write_text("")
    text = "\n".join(textwrap.dedent(replace.get(name, source)) for name, source in SECTIONS.items())
    (zoo / package / "model.py").write_text(text)
    cfg = JobConfig.from_flags(model_zoo=str(zoo), model_def=f"{package}.model.custom_model",
                               training_data=data_file, minibatch_size=4, max_bad_records=max_bad_records)
    return cfg, str(zoo / package / "model.py")


def error_of(tmp_path, data_file=None, kind=ModelSpecError, **replace: str) -> tuple[str, str]:
    cfg, path = config(tmp_path, data_file or data(tmp_path), **replace)
    with pytest.raises(kind) as info:
        check_job(cfg)
    return str(info.value), path


# ---------------------------------------------------------------- the model-zoo module


def test_custom_model_raising_anything_is_a_model_spec_error_naming_the_file(tmp_path):
    message, path = error_of(tmp_path, custom_model="""
        def custom_model(units=3):
            raise ValueError("no such layer size")
    """)
    assert message.startswith(f"{path}: custom_model() raised ValueError: no such layer size.")
    assert "Fix custom_model" in message


@pytest.mark.parametrize("batching", [".batch(2)", ".padded_batch(2)", ".map(lambda x, y: (x, y)).batch(3).unbatch().batch(2)"])
def test_a_dataset_fn_that_batches_is_named_with_the_fix(tmp_path, batching):
    message, path = error_of(tmp_path, dataset_fn=f"""
        def dataset_fn(dataset, mode, metadata):
            def parse(record):
                example = tf.io.parse_single_example(record, _FEATURES)
                return example["x"], example["y"]
            return dataset.map(parse){batching}
    """)
    assert message.startswith(f"{path}: dataset_fn batches its dataset (")
    assert "Remove .batch(...)" in message and "--minibatch_size" in message


def test_a_model_that_fails_on_every_batch_is_the_models_fault_not_the_datas(tmp_path):
    message, path = error_of(tmp_path, custom_model="""
        def custom_model(units=3):
            inputs = keras.Input(shape=(5,), name="x")
            return keras.Model(inputs, keras.layers.Dense(units, name="logits")(inputs))
    """)
    assert message.startswith(f"{path}: custom_model failed on a batch of dataset_fn's examples (features (4, 4)):")
    assert "Make dataset_fn yield the inputs custom_model takes" in message


# ---------------------------------------------------------------- labels against predictions


@pytest.mark.parametrize("loss, shapes", [
    ("tf.reduce_mean(keras.losses.mean_squared_error(labels, predictions))", "(4, 1) against predictions of shape (4, 3)"),
    ("keras.losses.MeanSquaredError()(labels, predictions)", "(4, 1) against predictions of shape (4, 3)"),
    ("tf.reduce_mean(tf.square(tf.cast(tf.reshape(labels, [-1]), tf.float32) - predictions[:, :1]))",
     "(4,) against predictions of shape (4, 1)"),
])
def test_a_loss_that_broadcasts_labels_against_predictions_fails_the_preflight(tmp_path, loss, shapes):
    message, path = error_of(tmp_path, loss=f"""
        def loss(labels, predictions):
            return {loss}
    """)
    assert message.startswith(f"{path}: loss(labels, predictions) broadcasts labels of shape {shapes}")
    assert "tf.one_hot" in message and "sparse_categorical_crossentropy" in message


@pytest.mark.parametrize("loss", [
    "tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True))",
    "keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, predictions)",
    "keras.losses.SparseCategoricalCrossentropy()(tf.reshape(labels, [-1]), tf.nn.softmax(predictions))",
    "tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.reshape(labels, [-1]), predictions))",
    "keras.losses.CategoricalCrossentropy(from_logits=True)(tf.one_hot(tf.reshape(labels, [-1]), 3), predictions)",
    "tf.reduce_mean(tf.cast(labels >= 0, tf.float32) * tf.nn.log_softmax(predictions)) * -1.0",
    "keras.losses.MeanSquaredError()(tf.cast(labels, tf.float32), predictions[:, :1])",
    "keras.losses.MeanSquaredError()(tf.cast(tf.reshape(labels, [-1]), tf.float32), predictions[:, :1])",
])
def test_losses_that_take_class_ids_or_matching_shapes_pass(tmp_path, loss):
    cfg, _ = config(tmp_path, data(tmp_path), loss=f"""
        def loss(labels, predictions):
            return {loss}
    """)
    check_job(cfg)


# ---------------------------------------------------------------- the first batch's numbers


def test_a_nan_loss_on_the_first_batch_fails_the_preflight_with_what_to_check(tmp_path):
    nan_data = data(tmp_path, [example(i, x=[float("nan")] * 4) for i in range(8)])
    message, path = error_of(tmp_path, nan_data)
    assert message.startswith(f"{path}: on the first 4 records of {nan_data}, the loss is nan before any training.")
    assert "NaN, Inf or huge values in the inputs" in message


def test_nonfinite_gradients_with_a_finite_loss_fail_the_preflight(tmp_path):
    message, _ = error_of(tmp_path, loss="""
        def loss(labels, predictions):
            return tf.reduce_mean(tf.sqrt(tf.square(predictions) * 0.0))
    """)
    assert "the gradients hold NaN or Inf before any training" in message


# ---------------------------------------------------------------- bad records in the first batch


def test_a_bad_record_in_the_first_batch_fails_by_default_and_is_skipped_with_max_bad_records(tmp_path):
    records = [example(i) for i in range(12)]
    records[1] = example(1, label=-1)
    bad_data = data(tmp_path, records)
    message, _ = error_of(tmp_path, bad_data, kind=BadRecordError)
    assert message.startswith(f"bad record: {bad_data}: record 1: InvalidArgumentError: Feature: y")
    cfg, _ = config(tmp_path, bad_data, max_bad_records=1)
    checked = check_job(cfg)
    assert tuple(checked.sample_features.shape) == (3, 4)  # the sample without record 1


def test_a_corrupt_record_in_the_first_batch_fails_by_default_and_is_skipped_with_max_bad_records(tmp_path):
    path = data(tmp_path)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    first = 12 + int.from_bytes(raw[:8], "little") + 4  # record 1 starts here
    raw[first + 12 + 3] ^= 0xFF  # a byte of its data: the framing stays intact
    with open(path, "wb") as f:
        f.write(raw)
    message, _ = error_of(tmp_path, path, kind=BadRecordError)
    assert message.startswith(f"bad record: {path}: record 1: data CRC mismatch (the file is corrupt).")
    cfg, _ = config(tmp_path, path, max_bad_records=1)
    check_job(cfg)


# ---------------------------------------------------------------- validation data


_WITH_METRICS = SECTIONS["optimizer"] + """
        def eval_metrics_fn():
            return {"accuracy": keras.metrics.SparseCategoricalAccuracy()}
"""


def test_validation_data_the_model_cannot_take_fails_at_submit_not_after_an_epoch(tmp_path):
    """The evaluation reads --validation_data only once an epoch is trained: its first batch
    goes through dataset_fn, the model and the metrics at submit, as the training data's does."""
    wider = data(tmp_path, [example(i, x=[0.1, 0.2, 0.3, 0.4, 0.5]) for i in range(6)])
    cfg, path = config(tmp_path, data(tmp_path), optimizer=_WITH_METRICS)
    check_job(cfg)  # the training data alone is fine
    with pytest.raises(ModelSpecError) as info:
        check_job(cfg.replace(validation_data=wider))
    message = str(info.value)
    assert message.startswith(f"{path}: dataset_fn failed on records of {wider}: ")
    assert check_job(cfg.replace(validation_data=data(tmp_path))).files  # the same features: fine
