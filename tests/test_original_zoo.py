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

# Every model as a full job (2 workers + 1 PS, export, evaluate, predict) takes several minutes
# on 2 cores: ELASTICDL_ACCEPTANCE=1 runs them all; the suite runs one, and every model's
# submit checks, training steps and export in one process (test_every_model_...).
ACCEPTANCE = os.environ.get("ELASTICDL_ACCEPTANCE") == "1"

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


def ctr_data(out: str, n: int, seed: int, suffix: str) -> str:
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        ids = rng.integers(1, 50, size=5)
        records.append(_example({"feature": ids, "label": np.array([int(ids[0] < 25)]),
                                 "I1": rng.integers(0, 100, size=1), "I2": rng.integers(0, 100, size=1),
                                 "C1": np.array([f"c{ids[0]}"]), "C2": np.array([f"d{ids[1]}"])}))
    return _write(os.path.join(out, f"ctr{suffix}"), records)


def heart_data(out: str, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "heart.csv")
    with open(path, "w") as f:
        for _ in range(n):
            age, bps, chol = rng.integers(29, 77), rng.integers(94, 200), rng.integers(126, 400)
            thal = rng.choice(["fixed", "normal", "reversible"])
            f.write(f"{age},{bps},{chol},{thal},{int(thal == 'reversible' or age > 60)}\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("original-zoo-data"))
    return {
        "mnist": images(os.path.join(out, "mnist"), (8, 8), 64, ".tfrecord", seed=1),
        "mnist_recordio": images(os.path.join(out, "mnist"), (8, 8), 64, ".recordio", seed=2),
        "cifar10": images(os.path.join(out, "cifar10"), (16, 16, 3), 64, ".recordio", seed=3),
        "census": census_data(os.path.join(out, "census"), 64, seed=4),
        "ctr": ctr_data(os.path.join(out, "ctr"), 64, seed=5, suffix=".tfrecord"),
        "dac": ctr_data(os.path.join(out, "dac"), 64, seed=6, suffix=".recordio"),
        "heart": heart_data(os.path.join(out, "heart"), 64, seed=7),
    }


CENSUS_FLAGS = {"feed": "census_feed", "loss": "census_loss", "optimizer": "census_optimizer",
                "eval_metrics_fn": "census_metrics"}
# (model_def, data, --model_params, function-name flags): the acceptance list of the issue.
MODELS = [
    ("mnist.mnist_functional_api.custom_model", "mnist", "", {}),
    ("mnist.mnist_subclass.CustomModel", "mnist_recordio", "", {}),
    ("cifar10.cifar10_subclass.CustomModel", "cifar10", "", {}),
    ("cifar10.cifar10_resnet50.custom_model", "cifar10", "", {}),
    ("cifar10.cifar10_mobilenetv2.custom_model", "cifar10", "", {}),
    ("cifar10.cifar10_functional_api.custom_model", "cifar10", "", {}),
    ("census.census_dnn.custom_model", "census", "", CENSUS_FLAGS),
    ("census.census_functional_api.custom_model", "census", "", {}),
    ("census.census_sequential.custom_model", "census", "", {}),
    ("census.census_subclass.CustomModel", "census", "", {}),
    ("census.census_wide_deep.custom_model", "census", "", {}),
    ("heart.heart_functional_api.custom_model", "heart", "", {}),
    ("deepfm.deepfm_functional_api.custom_model", "ctr", "", {}),
    ("deepfm.deepfm_edl_embedding.custom_model", "ctr", "", {}),
    ("resnet50_subclass.resnet50_subclass.CustomModel", "cifar10", "", {}),
    ("dac_ctr.elasticdl_train.custom_model", "dac", "model='wide_deep'", {}),
    ("dac_ctr.elasticdl_train.custom_model", "dac", "model='deepfm'", {}),
    ("dac_ctr.elasticdl_train.custom_model", "dac", "model='xdeepfm'", {}),
    ("dac_ctr.elasticdl_train.custom_model", "dac", "model='dcn'", {}),
    ("dac_ctr.wide_deep_train.custom_model", "dac", "", {}),  # one id group, its callbacks
    # The constructs of the five files an outside trial found failing (issue 30): the ODPS and
    # data-reader import paths, an unnamed Input fed a dict, lookup tables made in call().
    ("cifar10.cifar10_odps_outputs.custom_model", "cifar10", "", {}),
    ("deepfm.deepfm_masked.custom_model", "ctr", "", {}),
    ("census.census_lookup_wide_deep.custom_model", "census", "", {}),
]


def test_every_model_passes_the_submit_checks_trains_and_exports(data, tmp_path):
    """In one Keras 2 process: check_job (dataset_fn, model, loss, gradients, optimizer converted
    for the PS), three training steps, the SavedModel, and its serving signature on a batch."""
    cases = [json.dumps({"model_def": m, "data": data[d], "flags": {"model_params": p, **f}})
             for m, d, p, f in MODELS]
    # Every model in one process: about a minute of CPU, several minutes of a loaded 2-core machine.
    result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "original_zoo_smoke.py"), ZOO,
                             str(tmp_path / "exports"), *cases],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-5000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [o["model_def"] for o in outcomes] == [m for m, _, _, _ in MODELS]
    for outcome in outcomes:
        assert outcome["finite"], outcome
        assert set(outcome["serving_rows"].values()) == {8}, outcome  # one row per example of the batch
        assert "serve" in outcome["serving_rows"], outcome  # serving_default and serve, as Keras 3 exports
        assert outcome["serves_as_trained"], outcome  # the loaded SavedModel predicts what the model did
    by_name = {o["model_def"]: o for o in outcomes}
    assert by_name["census.census_dnn.custom_model"]["tables"] == [
        "education_embedding/embeddings", "workclass_embedding/embeddings"]  # embedding_column: PS tables
    assert by_name["cifar10.cifar10_subclass.CustomModel"]["optimizer"] == "RMSprop"
    assert by_name["heart.heart_functional_api.custom_model"]["tables"] == []  # tf's own: dense on the PS
    # Keras 2's BatchNormalization statistics train (sent as changes, as for Keras 3 models).
    assert by_name["cifar10.cifar10_resnet50.custom_model"]["non_trainable_moved"] == 30  # 15 BN layers x 2
    assert by_name["census.census_dnn.custom_model"]["non_trainable_moved"] == 0


def run(command: str, tmp_path, model_def: str, data: str, *flags: str) -> dict:
    data_flag = {"train": "--training_data", "evaluate": "--validation_data", "predict": "--prediction_data"}[command]
    args = [sys.executable, "-m", "elasticdl", command, "--model_zoo", ZOO, "--model_def", model_def,
            data_flag, data, "--num_workers", "2", "--num_ps", "1", "--minibatch_size", "16",
            "--num_threads_per_process", "1", "--job_name", f"{command}-{model_def.split('.')[1]}"[:40].replace("_", "-"),
            *flags]
    result = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    report["stderr"] = result.stderr
    return report


def _flag_args(params: str, flags: dict) -> list[str]:
    args = ["--model_params", params] if params else []
    for name, value in flags.items():
        args += [f"--{name}", value]
    return args


@pytest.mark.parametrize("model_def,data_key,params,flags", [
    pytest.param(*case, id=f"{case[0].split('.')[1]}{'-' + case[2].split('=')[1].strip(chr(39)) if case[2] else ''}",
                 marks=[] if ACCEPTANCE or case[0].endswith("deepfm_edl_embedding.custom_model")
                 else [pytest.mark.skip(reason="ELASTICDL_ACCEPTANCE=1 runs every model as a full job")])
    for case in MODELS
])
def test_full_job_two_workers_one_ps(data, tmp_path, model_def, data_key, params, flags):
    """Unedited: train with 2 workers + 1 PS (evaluating the validation data) and export, then
    predict on its checkpoint (and, with ELASTICDL_ACCEPTANCE=1, evaluate it again)."""
    extra = _flag_args(params, flags)
    report = run("train", tmp_path, model_def, data[data_key], "--validation_data", data[data_key],
                 "--checkpoint_dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "model"), *extra)
    assert "the model-zoo module runs on Keras 2" in report["stderr"]
    assert report["records_trained"] == 64
    assert os.path.exists(os.path.join(report["saved_model"], "saved_model.pb"))
    assert report["metrics"] and all(np.isfinite(v) for v in report["metrics"].values())
    if ACCEPTANCE:  # the training's own final round already evaluated this checkpoint's model
        evaluated = run("evaluate", tmp_path, model_def, data[data_key],
                        "--checkpoint_dir_for_init", report["checkpoint"], *extra)
        for name, value in evaluated["metrics"].items():  # the same model, the same data
            assert value == pytest.approx(report["metrics"][name], abs=1e-5), name
    outputs = tmp_path / "processor"
    outputs.mkdir()
    ENV["DAC_OUTPUTS"] = str(outputs)
    try:
        predicted = run("predict", tmp_path, model_def, data[data_key], "--checkpoint_dir_for_init",
                        report["checkpoint"], "--prediction_outputs", str(tmp_path / "pred"), *extra)
    finally:
        ENV.pop("DAC_OUTPUTS")
    if model_def.startswith("dac_ctr.elasticdl_train"):  # its PredictionOutputsProcessor got tensors (it asserts so)
        probs = np.concatenate([np.loadtxt(p, ndmin=1) for p in outputs.iterdir()])
        assert probs.shape == (64,)
    elif model_def.startswith("cifar10.cifar10_odps_outputs"):  # no ODPS: its processor logs the batches
        logs = "".join(p.read_text() for p in (tmp_path / predicted["log_dir"]).glob("worker-*.log"))
        assert logs.count("elasticdl.model_zoo: [[") >= 4  # 64 records in batches of 16 (more if retried)
    else:
        rows = np.loadtxt(tmp_path / "pred" / "predictions.csv", delimiter=",", skiprows=1, ndmin=2)
        assert rows.shape[0] == 64 and np.all(np.isfinite(rows))


KERAS2_DICT_FEEDING = r"""
import json
import tensorflow as tf
from elasticdl.model.keras_generation import feed_dicts_as_keras2_did

def built(inputs, outputs):
    model = tf.keras.Model(inputs=inputs, outputs=outputs)
    feed_dicts_as_keras2_did(model)
    return model

a, b = tf.keras.Input(shape=(1,)), tf.keras.Input(shape=(1,))  # unnamed: input_1, input_2
two = built([a, b], a - b)
x, y = tf.keras.Input(shape=(1,), name="x"), tf.keras.Input(shape=(1,), name="y")
named = built([x, y], x - y)
one = tf.constant([[1.0]]); ten = tf.constant([[10.0]])
print(json.dumps({
    "key_order": float(two({"b_second": one, "a_first": ten})[0, 0]),  # values in key order: 10 - 1
    "by_name": float(named({"y": one, "x": ten, "extra": one})[0, 0]),  # names win: 10 - 1
    "named_spec_kept": named.input_spec is not None,  # its shape checks stay
    "sequential_spec_kept": tf.keras.Sequential([tf.keras.Input(shape=(1,)), tf.keras.layers.Dense(1)]).input_spec is not None,
}))
"""


def test_keras2_functional_models_take_dicts_as_tf_keras_2_did():
    """Unnamed Inputs fed a dict take its values in key order; named ones take them by name, the
    dict's other keys ignored (tf.keras 2's rule, which newer tf_keras refused before applying)."""
    env = {**ENV, "TF_USE_LEGACY_KERAS": "1"}
    result = subprocess.run([sys.executable, "-c", KERAS2_DICT_FEEDING], env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "key_order": 9.0, "by_name": 9.0, "named_spec_kept": True, "sequential_spec_kept": True}
