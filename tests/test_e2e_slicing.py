"""End to end with sliced dense variables (--slice_dense_above_mb): the benchmark's 5M-parameter
MLP on 2 PS with 2 workers, its five large kernels one slice per PS: it trains with every record
applied exactly once on both PS, each PS holds about half the model, and the exported SavedModel
predicts what the checkpoint's joined variables predict. Its checkpoint then restarts a job on
3 PS with a backup of each shard (--ps_replicas 1): cut again into thirds, it trains on."""

from __future__ import annotations

import glob
import os
import sys

import numpy as np
import pytest

from elasticdl.model.slicing import join, parse_slice_name
from tests.test_e2e_local import elasticdl, report_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = 1280
KERNELS = [f"dense_{i}/kernel" for i in range(5)]  # 768x1024 and 4 of 1024x1024: 3 and 4 MiB


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    sys.path.insert(0, REPO)
    from benchmarks.data import prepare

    root = tmp_path_factory.mktemp("dense")
    return prepare(str(root), {"dense": {"kind": "dense", "records": RECORDS, "dim": 768}})["dense"]["dir"]


def _args(dense, tmp_path, **flags) -> list[str]:
    args = ["train", "--model_zoo", os.path.join(REPO, "benchmarks", "model_zoo"),
            "--model_def", "dense.dense_mlp.custom_model", "--training_data", dense,
            "--minibatch_size", "64", "--num_epochs", "1", "--slice_dense_above_mb", "1"]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args


def _shards(version_dir: str) -> list[dict[str, np.ndarray]]:
    shards = []
    for path in sorted(glob.glob(os.path.join(version_dir, "ps-*.npz"))):
        with np.load(path) as data:
            shards.append({k.partition(":")[2]: data[k] for k in data.files if k.startswith("param:")})
    return shards


def _joined(shards: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    slices: dict[str, dict] = {}
    for shard in shards:
        for name, value in shard.items():
            parsed = parse_slice_name(name)
            key, index, count = (name, 0, 1) if parsed is None else (parsed.whole, parsed.index, parsed.count)
            assert index not in slices.setdefault(key, {}), f"{name} is on two PS"
            slices[key][index] = (count, value)
    return {name: join(name, parts) for name, parts in slices.items()}


def test_a_sliced_dense_model_trains_exactly_once_exports_and_restores_on_3_ps(dense, tmp_path):
    import tensorflow as tf

    first = report_of(elasticdl(_args(dense, tmp_path, num_workers=2, num_ps=2, checkpoint_dir=tmp_path / "ckpt",
                                      output=tmp_path / "model"), cwd=tmp_path, timeout=600))
    assert first["exactly_once"] == {"records_applied": [RECORDS] * 2, "records_done": RECORDS, "holds": True}
    shards = _shards(first["checkpoint"])
    for ps_id, shard in enumerate(shards):
        assert {k for k in shard if "#" in k} == {f"{k}#slice-{ps_id}-of-2" for k in KERNELS}
    held = [sum(v.nbytes for v in shard.values()) for shard in shards]
    assert abs(held[0] - held[1]) < 0.05 * sum(held), held  # by name hash alone: 8.0 MiB against 11.0
    params = _joined(shards)
    assert params["dense_0/kernel"].shape == (768, 1024)

    # The SavedModel predicts what the checkpoint's joined variables do.
    sys.path.insert(0, os.path.join(REPO, "benchmarks", "model_zoo"))
    from dense.dense_mlp import custom_model

    model = custom_model()
    for variable in model.weights:
        variable.assign(params[variable.path])
    x = np.random.default_rng(0).normal(size=(4, 768)).astype(np.float32)
    serving = tf.saved_model.load(first["saved_model"]).signatures["serving_default"]
    argument = list(serving.structured_input_signature[1])[0]
    served = list(serving(**{argument: tf.constant(x)}).values())[0].numpy()
    np.testing.assert_allclose(served, model(x).numpy(), rtol=1e-5, atol=1e-5)

    second = report_of(elasticdl(_args(dense, tmp_path, num_workers=1, num_ps=3, ps_replicas=1,
                                       checkpoint_dir_for_init=tmp_path / "ckpt", checkpoint_dir=tmp_path / "ckpt3"),
                                 cwd=tmp_path, timeout=600))
    assert second["model_version"] > first["model_version"]
    assert second["exactly_once"]["holds"], second["exactly_once"]
    thirds = _shards(second["checkpoint"])
    assert len(thirds) == 3
    for ps_id, shard in enumerate(thirds):
        assert {k for k in shard if "#" in k} == {f"{k}#slice-{ps_id}-of-3" for k in KERNELS}
    assert set(_joined(thirds)) == set(params)
