"""The original ElasticDL's import paths that its model zoo uses beyond the model itself:
``MaxComputeConfig``, ``elasticdl.python.data.*`` (ODPS and file readers: they import, and
refuse when used, naming the alternative) and ``MaxStepsStopping``."""

from __future__ import annotations

import pytest

from elasticdl.errors import UserError
from elasticdl.python.common.constants import MaxComputeConfig, Mode, ODPSConfig
from elasticdl.python.data.odps_io import ODPSReader, ODPSWriter, is_odps_configured
from elasticdl.python.data.reader.csv_reader import CSVDataReader
from elasticdl.python.data.reader.data_reader import AbstractDataReader, Metadata, check_required_kwargs
from elasticdl.python.data.reader.data_reader_factory import create_data_reader
from elasticdl.python.data.reader.odps_reader import ODPSDataReader
from elasticdl.python.data.reader.recordio_reader import RecordIODataReader
from elasticdl.python.data.reader.text_reader import TextDataReader

ODPS_ENV = {MaxComputeConfig.PROJECT_NAME: "p", MaxComputeConfig.ACCESS_ID: "id",
            MaxComputeConfig.ACCESS_KEY: "key", MaxComputeConfig.ENDPOINT: "http://odps"}


def test_maxcompute_config_names_the_original_environment_variables():
    assert (MaxComputeConfig.PROJECT_NAME, MaxComputeConfig.ACCESS_ID, MaxComputeConfig.ACCESS_KEY,
            MaxComputeConfig.ENDPOINT) == ("MAXCOMPUTE_PROJECT", "MAXCOMPUTE_AK", "MAXCOMPUTE_SK", "MAXCOMPUTE_ENDPOINT")
    assert ODPSConfig is MaxComputeConfig and Mode.TRAINING == "training"


def test_odps_is_configured_only_with_every_variable(monkeypatch):
    for name in ODPS_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not is_odps_configured()
    for name, value in list(ODPS_ENV.items())[:-1]:
        monkeypatch.setenv(name, value)
    assert not is_odps_configured()  # the endpoint is missing
    monkeypatch.setenv(MaxComputeConfig.ENDPOINT, "http://odps")
    assert is_odps_configured()


@pytest.mark.parametrize("make,alternative", [
    (lambda: ODPSWriter("p", "id", "key", "http://odps", "table", columns=["f0"]), "--prediction_outputs"),
    (lambda: ODPSReader("p", "id", "key", "http://odps", "table"), "--training_data"),
    (lambda: ODPSDataReader(table="t"), "--training_data"),
    (lambda: RecordIODataReader(data_dir="data"), "--training_data"),
    (lambda: CSVDataReader(sep=","), "--training_data"),
    (lambda: TextDataReader(filename="a.txt"), "--training_data"),
])
def test_each_reader_and_writer_refuses_when_used_naming_the_alternative(make, alternative):
    with pytest.raises(UserError) as err:
        make()
    assert alternative in str(err.value)
    if alternative == "--training_data":  # the records are then parsed where the model zoo parses
        assert "dataset_fn" in str(err.value)


def test_the_factory_refuses_with_the_odps_message_when_odps_is_configured(monkeypatch):
    for name, value in ODPS_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="ODPS.*Parquet.*--training_data"):
        create_data_reader("odps://project/tables/t")
    for name in ODPS_ENV:
        monkeypatch.delenv(name)
    with pytest.raises(UserError, match="RecordIODataReader: ElasticDL reads"):
        create_data_reader("data/train")


def test_a_module_can_subclass_a_reader_and_use_its_helpers():
    class CustomDataReader(RecordIODataReader):  # the original's test module does this at import
        def custom_method(self):
            return "custom"

    assert issubclass(CustomDataReader, AbstractDataReader)
    assert Metadata(column_names=["a"]).column_names == ["a"]
    check_required_kwargs(["data_dir"], {"data_dir": "x"})
    with pytest.raises(ValueError, match="data_dir"):
        check_required_kwargs(["data_dir"], {})
    with pytest.raises(UserError, match="CustomDataReader"):
        CustomDataReader(data_dir="x")


class _Job:
    def __init__(self):
        self.stops: list[str] = []

    def stop_training(self, reason: str) -> None:
        self.stops.append(reason)


def test_max_steps_stopping_stops_once_at_the_model_version():
    from elasticdl.python.elasticdl.callbacks import MaxStepsStopping

    callback, job = MaxStepsStopping(max_steps=20), _Job()
    callback.set_job(job)
    for version in (5, 19):
        callback.on_model_version(version)
    assert job.stops == []
    callback.on_model_version(23)
    callback.on_model_version(30)
    assert job.stops == ["MaxStepsStopping: model version 23 reached max_steps=20"]
    with pytest.raises(ValueError, match="max_steps"):
        MaxStepsStopping(max_steps=0)
