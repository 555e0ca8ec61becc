"""predictions.csv's columns carry the model's output names (was output_0 ... output_N)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from elasticdl.data.sources import Shard
from elasticdl.model import prediction


def _two_outputs(as_dict: bool):
    inputs = keras.Input((3,), name="x")
    ctr = keras.layers.Dense(1, name="ctr")(inputs)
    probs = keras.layers.Dense(4, name="probs")(inputs)
    return keras.Model(inputs, {"probs": probs, "ctr": ctr} if as_dict else [ctr, probs])


def _predict_csv(tmp_path, model, batches: int = 2) -> list[str]:
    outputs = str(tmp_path / "pred")
    shards = []
    for i in range(batches):
        predictions = model(np.full((2, 3), i, np.float32))
        numpy = {k: np.asarray(v) for k, v in predictions.items()} if isinstance(predictions, dict) else (
            [np.asarray(v) for v in predictions] if isinstance(predictions, list) else np.asarray(predictions))
        prediction.write_part(outputs, "data.tfrecord", 2 * i, [numpy], prediction.output_names(model))
        shards.append(Shard("data.tfrecord", 2 * i, 2 * i + 2))
    return open(prediction.join_parts(outputs, shards)).read().splitlines()


def test_a_two_output_model_s_columns_are_its_output_names(tmp_path):
    lines = _predict_csv(tmp_path, _two_outputs(as_dict=False))
    assert lines[0] == "ctr,probs_0,probs_1,probs_2,probs_3"
    assert len(lines) == 5 and all(len(line.split(",")) == 5 for line in lines[1:])


def test_a_dict_of_outputs_is_laid_out_by_sorted_key_under_its_keys(tmp_path):
    lines = _predict_csv(tmp_path, _two_outputs(as_dict=True))
    assert lines[0] == "ctr,probs_0,probs_1,probs_2,probs_3"


def test_a_single_output_is_named_after_its_layer(tmp_path):
    inputs = keras.Input((3,), name="x")
    lines = _predict_csv(tmp_path, keras.Model(inputs, keras.layers.Dense(3, name="logits")(inputs)))
    assert lines[0] == "logits_0,logits_1,logits_2"


def test_outputs_without_names_keep_output_i(tmp_path):
    class Unnamed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    assert _predict_csv(tmp_path, Unnamed())[0] == "output_0,output_1"
