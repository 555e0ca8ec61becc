"""End to end, with real processes: a bad record fails the job with its file and index, or is
skipped with --max_bad_records and listed in the report; training that diverges fails the job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")
BAD_INDEX = 300  # past the preflight's sample: a worker finds it


@pytest.fixture(scope="module")
def digits_with_a_bad_record(tmp_path_factory):
    """digits' training files, the second with record BAD_INDEX missing its label."""
    import tensorflow as tf

    from elasticdl.data.tfrecord import count_records, read_records, write_records

    out = tmp_path_factory.mktemp("digits")
    subprocess.run(
        [sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"), "--output", str(out)],
        check=True, capture_output=True,
    )
    train = out / "train"
    bad_file = str(train / "digits-001.tfrecord")
    records = list(read_records(bad_file, 0, count_records(bad_file)))
    example = tf.train.Example.FromString(records[BAD_INDEX])
    del example.features.feature["label"]
    records[BAD_INDEX] = example.SerializeToString()
    write_records(bad_file, records)
    return train, bad_file


def elasticdl(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticdl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)


def train_args(data, job_name: str, model_zoo: str = MODEL_ZOO, model_def="digits.digits_functional.custom_model",
               **flags) -> list[str]:
    args = ["train", "--model_zoo", model_zoo, "--model_def", model_def, "--training_data", str(data),
            "--minibatch_size", "32", "--num_epochs", "1", "--num_workers", "1", "--num_ps", "1",
            "--job_name", job_name]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args


def test_a_bad_record_fails_the_job_with_its_file_and_index(digits_with_a_bad_record, tmp_path):
    train, bad_file = digits_with_a_bad_record
    result = elasticdl(train_args(train, "bad-record"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"elasticdl train: error: bad record: {bad_file}: record {BAD_INDEX}: "
                           "InvalidArgumentError: Feature: label (data type: int64) is required"), last
    assert "--max_bad_records" in last
    with open(tmp_path / "runs" / "bad-record" / "report.json") as f:
        report = json.load(f)
    assert report["status"] == "failed" and report["exit_code"] == 2
    assert [(r["path"], r["index"]) for r in report["bad_records"]] == [(bad_file, BAD_INDEX)]


def test_max_bad_records_skips_the_record_and_the_report_lists_it(digits_with_a_bad_record, tmp_path):
    train, bad_file = digits_with_a_bad_record
    result = elasticdl(train_args(train, "skip-bad", max_bad_records=1), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert [(r["path"], r["index"]) for r in report["bad_records"]] == [(bad_file, BAD_INDEX)]
    assert "Feature: label (data type: int64) is required" in report["bad_records"][0]["reason"]
    assert report["max_bad_records"] == 1
    assert report["records_trained"] == 1437 - 1 and report["dropped_tasks"] == 0


def test_training_that_diverges_fails_the_job_naming_the_task_and_what_to_check(digits_with_a_bad_record, tmp_path):
    train, bad_file = digits_with_a_bad_record
    zoo = tmp_path / "zoo" / "diverging"
    zoo.mkdir(parents=True)
    shutil.copy(os.path.join(MODEL_ZOO, "digits", "digits_functional.py"), zoo / "digits_functional.py")
    (zoo / "model.py").write_text(
        "import keras\n"
        "from diverging.digits_functional import custom_model, dataset_fn, loss  # noqa: F401\n"
        "def optimizer(lr=1e30):\n    return keras.optimizers.SGD(learning_rate=lr)\n"
    )
    (zoo / "__init__.py").write_text("")
    data = tmp_path / "good"
    data.mkdir()
    shutil.copy(train / "digits-000.tfrecord", data)  # the file without the bad record
    result = elasticdl(train_args(data, "diverges", model_zoo=str(tmp_path / "zoo"),
                                  model_def="diverging.model.custom_model"),
                       cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("elasticdl train: error: worker 0: TrainingDivergedError: task "), last
    assert "3 batches in a row had a NaN or Inf loss or gradients" in last
    assert "Lower the learning rate" in last
