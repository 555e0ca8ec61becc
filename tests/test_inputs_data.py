"""Every flag that names data is checked at submit by the same rules, before any process
starts: each file is counted from its framing (a file that cannot be read, or is in no format
the readers know, is named with the flag), and data holding no record at all is refused.

--validation_data of `elasticdl train` was only looked up: an empty validation file crashed
the job after a whole epoch of training, when the first evaluation read it.
"""

from __future__ import annotations

import pytest

from elasticdl.config import JobConfig
from elasticdl.data.errors import DataError, NoDataFilesError
from elasticdl.data.tfrecord import write_records
from elasticdl.master import preflight
from elasticdl.master.preflight import check_inputs

# (command, the flag of the data under test); train also needs good training data.
FLAGS = [("train", "training_data"), ("train", "validation_data"), ("evaluate", "validation_data"),
         ("predict", "prediction_data")]


@pytest.fixture
def job(tmp_path):
    """flags -> check_inputs(config, command) for a model zoo whose file exists (nothing imported)."""
    (tmp_path / "zoo" / "m").mkdir(parents=True)
    (tmp_path / "zoo" / "m" / "model.py").write_text("def custom_model():\n    pass\n")
    (tmp_path / "ckpt").mkdir()
    good = tmp_path / "good.tfrecord"
    write_records(good, [b"record-%d" % i for i in range(5)])

    def check(command: str, **flags):
        base = {"model_zoo": str(tmp_path / "zoo"), "model_def": "m.model.custom_model",
                "training_data": str(good)}
        if command != "train":
            base = {**base, "training_data": "", "checkpoint_dir_for_init": str(tmp_path / "ckpt")}
        return check_inputs(JobConfig.from_flags(**{**base, **flags}).with_defaults(), command)

    return check


def _file(tmp_path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("command, name", FLAGS)
def test_data_holding_no_record_is_refused_naming_the_flag(job, tmp_path, command, name):
    empty = _file(tmp_path, "empty.tfrecord", b"")
    with pytest.raises(DataError, match=rf"--{name} '.*empty.tfrecord' holds no records: 1 file, all empty"):
        job(command, **{name: empty})
    header_only = _file(tmp_path, "header.csv", b"a,b\n")
    with pytest.raises(DataError, match=rf"--{name} .* holds no records.*a CSV header line is no record"):
        job(command, **{name: header_only}, data_reader_params="has_header=True")


def test_an_empty_validation_file_among_others_is_fine_as_for_training(job, tmp_path):
    records = _file(tmp_path, "some.tfrecord", b"")
    write_records(records, [b"x", b"y"])
    empty = _file(tmp_path, "empty.tfrecord", b"")
    assert job("train", validation_data=f"{records},{empty}")
    assert job("evaluate", validation_data=f"{records},{empty}") == [(records, 2), (empty, 0)]


@pytest.mark.parametrize("command, name", FLAGS)
@pytest.mark.parametrize("file, content, form", [
    ("text.tfrecord", b"this is no TFRecord file, only text\n", "tfrecord"),
    ("bad.parquet", b"garbage", "parquet"),
])
def test_a_file_in_another_format_is_refused_naming_the_flag(job, tmp_path, command, name, file, content, form):
    path = _file(tmp_path, file, content)
    with pytest.raises(DataError, match=rf"--{name}: .*{file} cannot be read as {form} .* or remove it from --{name}"):
        job(command, **{name: path})


@pytest.mark.parametrize("command, name", FLAGS)
def test_a_file_that_cannot_be_read_is_refused_naming_the_flag(job, tmp_path, monkeypatch, command, name):
    path = _file(tmp_path, "locked.tfrecord", b"")
    count = preflight.count_records

    def unreadable(p, has_header=False):  # a file this user may not read (root reads any, so: played)
        if p.endswith("locked.tfrecord"):
            raise PermissionError(13, "Permission denied", p)
        return count(p, has_header)

    monkeypatch.setattr(preflight, "count_records", unreadable)
    with pytest.raises(DataError, match=rf"--{name}: cannot read .*locked.tfrecord: Permission denied"):
        job(command, **{name: path})


@pytest.mark.parametrize("command, name", FLAGS)
def test_a_path_naming_no_file_is_refused_naming_the_flag(job, tmp_path, command, name):
    with pytest.raises(NoDataFilesError, match=rf"^--{name}: no data files found for '.*missing'"):
        job(command, **{name: str(tmp_path / "missing")})
