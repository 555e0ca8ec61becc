"""End to end: every worker preprocesses with the master's adapted FeatureSpace (issue 30).

tests/zoo/adaptzoo/feature_space_pid.py adapts a FeatureSpace at import on data seeded from
its pid, so every process that imports it adapts different ``age`` bins, ``city`` vocabulary
and ``income`` mean. Two workers train it; each process's dataset_fn writes the state it
preprocessed with, and all of them (the master's and both workers') must be one.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(REPO, "tests", "zoo")


def _write_data(directory) -> None:
    import tensorflow as tf

    from elasticdl.data.tfrecord import write_records

    rng = np.random.default_rng(0)

    def example(i):
        age, income = float(rng.normal(40, 12)), float(rng.normal(50, 20))
        return tf.train.Example(features=tf.train.Features(feature={
            "age": tf.train.Feature(float_list=tf.train.FloatList(value=[age])),
            "city": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f"city{i % 12}".encode()])),
            "income": tf.train.Feature(float_list=tf.train.FloatList(value=[income])),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(age > 40)])),
        })).SerializeToString()

    os.makedirs(directory)
    write_records(os.path.join(directory, "data.tfrecord"), (example(i) for i in range(256)))


def test_two_workers_preprocess_with_the_masters_feature_space(tmp_path):
    _write_data(tmp_path / "train")
    states = tmp_path / "states"
    states.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", ZOO,
         "--model_def", "adaptzoo.feature_space_pid.custom_model", "--job_name", "adapt",
         "--training_data", str(tmp_path / "train"), "--minibatch_size", "32", "--num_epochs", "1",
         "--num_workers", "2", "--num_ps", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "ADAPTZOO_STATE_DIR": str(states)},
    )
    assert result.returncode == 0, result.stderr[-4000:]

    seen = {os.path.basename(p): json.loads(open(p).read()) for p in glob.glob(str(states / "*.json"))}
    assert len(seen) >= 3, seen.keys()  # the master's process and the two workers'
    first = next(iter(seen.values()))
    assert len(first["age_bins"]) == 5 and len(first["cities"]) > 1
    assert all(state == first for state in seen.values()), seen

    logs = tmp_path / "runs" / "adapt" / "logs"
    master = open(logs / "master.log").read()
    (sent,) = re.findall(r"preprocessing state (\w+) \(\d+ layers\) handed to the workers", master)
    taken = [re.findall(r"preprocessing state (\w+) \(\d+ layers\) from the master", open(p).read())
             for p in glob.glob(str(logs / "worker-*.log"))]
    assert len(taken) == 2 and all(found == [sent] for found in taken), (sent, taken)
