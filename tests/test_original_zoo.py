"""The original ElasticDL's model-zoo conventions, unedited: modules of our own written the way
its Keras model zoo is (tests/zoo/original: Keras 2 via tf.keras, feature columns, the legacy
``elasticdl.python...`` paths, ``from model_zoo.x import y``, function-name flags), each on
synthetic data of its own format (RecordIO where the original used RecordIO), trained with 2
workers and 1 PS, exported, and (where cheap) evaluated and predicted on its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tf_keras")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(REPO, "tests", "zoo", "original")
ENV = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
ENV.pop("TF_USE_LEGACY_KERAS", None)  # the job decides it from the module


def _example(features: dict) -> bytes:
    """A serialized tf.train.Example, built with the protobuf classes TensorFlow ships."""
    from tensorflow.core.example import example_pb2, feature_pb2

    feature = {}
    for name, value in features.items():
        value = np.asarray(value).reshape(-1)
        if value.dtype.kind == "f":
            feature[name] = feature_pb2.Feature(float_list=feature_pb2.FloatList(value=value.tolist()))
        elif value.dtype.kind in "iu":
            feature[name] = feature_pb2.Feature(int64_list=feature_pb2.Int64List(value=value.tolist()))
        else:
            feature[name] = feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[str(v).encode() for v in value]))
    return example_pb2.Example(features=feature_pb2.Features(feature=feature)).SerializeToString()


def _write(path: str, records: list[bytes]) -> str:
    from elasticdl.data.recordio import write_records as write_recordio
    from elasticdl.data.tfrecord import write_records as write_tfrecord

    os.makedirs(os.path.dirname(path), exist_ok=True)
    (write_recordio if path.endswith(".recordio") else write_tfrecord)(path, records)
    return path


def images(out: str, shape: tuple, n: int, suffix: str, seed: int) -> str:
    """Class-coloured noise images: class c has its pixels brighter in row block c."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        label = int(rng.integers(10))
        image = rng.uniform(0, 120, size=shape).astype(np.float32)
        image.reshape(shape[0], -1)[label % shape[0]] += 120
        records.append(_example({"image": image, "label": np.array([label])}))
    return _write(os.path.join(out, f"images{suffix}"), records)


def run(command: str, tmp_path, model_def: str, data: str, *flags: str) -> dict:
    data_flag = {"train": "--training_data", "evaluate": "--validation_data", "predict": "--prediction_data"}[command]
    args = [sys.executable, "-m", "elasticdl", command, "--model_zoo", ZOO, "--model_def", model_def,
            data_flag, data, "--num_workers", "2", "--num_ps", "1", "--minibatch_size", "16",
            "--num_threads_per_process", "1", "--job_name", f"{command}-{model_def.split('.')[1]}"[:40].replace("_", "-"),
            *flags]
    result = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    report["stderr"] = result.stderr
    return report


def train(tmp_path, model_def: str, data: str, *flags: str) -> dict:
    report = run("train", tmp_path, model_def, data, "--checkpoint_dir", str(tmp_path / "ckpt"),
                 "--output", str(tmp_path / "model"), *flags)
    assert "the model-zoo module runs on Keras 2" in report["stderr"]
    assert os.path.exists(os.path.join(report["saved_model"], "saved_model.pb"))
    return report


def test_mnist_functional_api(tmp_path):
    data = images(str(tmp_path / "data"), (8, 8), 96, ".tfrecord", seed=1)
    report = train(tmp_path, "mnist.mnist_functional_api.custom_model", data, "--validation_data", data)
    assert report["records_trained"] == 96
    assert "mnist_functional_api.py writes tf.keras" in report["stderr"]
    assert 0.0 <= report["metrics"]["accuracy"] <= 1.0
    evaluated = run("evaluate", tmp_path, "mnist.mnist_functional_api.custom_model", data,
                    "--checkpoint_dir_for_init", report["checkpoint"])
    assert evaluated["metrics"]["accuracy"] == pytest.approx(report["metrics"]["accuracy"])


def test_mnist_subclass_on_recordio(tmp_path):
    data = images(str(tmp_path / "data"), (8, 8), 64, ".recordio", seed=2)
    report = train(tmp_path, "mnist.mnist_subclass.CustomModel", data)
    assert report["records_trained"] == 64
    assert "returns shape (16,), not a scalar: training on its mean" in report["stderr"]


def census_data(out: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        age, hours = rng.uniform(18, 70), rng.uniform(10, 60)
        work, edu = rng.choice(["private", "gov", "self"]), rng.choice(["hs", "ba", "phd"])
        label = int(age / 70 + (edu == "phd") + rng.normal(0, 0.2) > 0.9)
        records.append(_example({"age": np.array([age], np.float32), "hours": np.array([hours], np.float32),
                                 "workclass": np.array([work]), "education": np.array([edu]),
                                 "label": np.array([label])}))
    return _write(os.path.join(out, "census.tfrecord"), records)


def test_census_feature_columns_with_function_name_flags_and_legacy_flags(tmp_path):
    data = census_data(str(tmp_path / "data"), 96, seed=3)
    report = train(tmp_path, "census.census_dnn.custom_model", data, "--validation_data", data,
                   "--feed", "census_feed", "--loss", "census_loss", "--optimizer", "census_optimizer",
                   "--eval_metrics_fn", "census_metrics",
                   "--distribution_strategy", "ParameterServerStrategy", "--need_elasticdl_job_service", "true")
    assert "census_dnn.py uses feature columns" in report["stderr"]
    assert "ignoring --distribution_strategy" in report["stderr"]
    assert "ignoring the original ElasticDL's --need_elasticdl_job_service" in report["stderr"]
    assert set(report["metrics"]) == {"accuracy", "auc"}
    # The embedding columns' rows live on the PS as tables, not as dense variables.
    with np.load(os.path.join(report["checkpoint"], "ps-0-of-1.npz")) as shard:
        tables = sorted(k for k in shard.files if k.startswith("embedding_ids:"))
    assert tables == ["embedding_ids:education_embedding/embeddings", "embedding_ids:workclass_embedding/embeddings"]
    predicted = run("predict", tmp_path, "census.census_dnn.custom_model", data,
                    "--checkpoint_dir_for_init", report["checkpoint"], "--feed", "census_feed",
                    "--loss", "census_loss", "--optimizer", "census_optimizer",
                    "--prediction_outputs", str(tmp_path / "pred"))
    rows = np.loadtxt(tmp_path / "pred" / "predictions.csv", delimiter=",", skiprows=1)
    assert rows.shape == (96,) and np.all((rows >= 0) & (rows <= 1))


def test_allreduce_is_refused_with_the_alternative(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", ZOO, "--model_def", "mnist.mnist_subclass.CustomModel",
         "--training_data", "x", "--distribution_strategy", "AllreduceStrategy"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "AllreduceStrategy is not supported" in result.stderr and "--num_ps" in result.stderr


def ctr_data(out: str, n: int, seed: int, suffix: str) -> str:
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        ids = rng.integers(1, 50, size=5)
        records.append(_example({"feature": ids, "label": np.array([int(ids[0] < 25)]),
                                 "I1": rng.integers(0, 100, size=1), "I2": rng.integers(0, 100, size=1),
                                 "C1": np.array([f"c{ids[0]}"]), "C2": np.array([f"d{ids[1]}"])}))
    return _write(os.path.join(out, f"ctr{suffix}"), records)


def test_deepfm_edl_embedding_nested_metrics_get_the_labels_tensor(tmp_path):
    data = ctr_data(str(tmp_path / "data"), 96, seed=4, suffix=".tfrecord")
    report = train(tmp_path, "deepfm.deepfm_edl_embedding.custom_model", data, "--validation_data", data)
    assert set(report["metrics"]) == {"logits/accuracy", "probs/auc"}
    with np.load(os.path.join(report["checkpoint"], "ps-0-of-1.npz")) as shard:
        assert sum(k.startswith("embedding_ids:") for k in shard.files) == 2


def test_dac_ctr_model_zoo_imports_feed_and_prediction_processor_on_recordio(tmp_path):
    data = ctr_data(str(tmp_path / "data"), 96, seed=5, suffix=".recordio")
    report = train(tmp_path, "dac_ctr.elasticdl_train.custom_model", data)
    assert report["records_trained"] == 96
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    ENV["DAC_OUTPUTS"] = str(outputs)
    try:
        run("predict", tmp_path, "dac_ctr.elasticdl_train.custom_model", data,
            "--checkpoint_dir_for_init", report["checkpoint"])
    finally:
        ENV.pop("DAC_OUTPUTS")
    probs = np.concatenate([np.loadtxt(p, ndmin=1) for p in outputs.iterdir()])
    assert probs.shape == (96,) and np.all((probs > 0) & (probs < 1))
