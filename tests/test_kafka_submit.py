"""Submit-time checks of a stream job: its flags, the broker and the topic, before any process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kafka_fixture import _free_port, kafka_broker  # noqa: F401  (pytest finds fixtures by name)

from elasticdl.config import ConfigError, JobConfig
from elasticdl.data.errors import DataError
from elasticdl.master.preflight import check_inputs
from tests.test_e2e_local import MODEL_ZOO

MODEL_DEF = "digits.digits_functional.custom_model"


def _config(training_data: str, **flags) -> JobConfig:
    return JobConfig.from_flags(model_zoo=MODEL_ZOO, model_def=MODEL_DEF, training_data=training_data, **flags)


@pytest.mark.parametrize("flags, message", [
    ({"stream_start": "newest"}, "--stream_start must be earliest or latest. Received: 'newest'"),
    ({"training_data": "data/digits/train", "stream_idle_secs": 5.0},
     "--stream_idle_secs applies to a stream .* drop --stream_idle_secs"),
    ({"training_data": "data/digits/train", "kafka_group": "g"}, "--kafka_group applies to a stream .* drop --kafka_group"),
    ({"export_every_secs": 10.0}, r"--export_every_secs writes versioned exports .* set --output"),
    ({"export_every_secs": 10.0, "output": "s3://bucket/models"}, r"--export_every_secs renames .* local or mounted"),
    ({"training_data": "data/digits/train", "export_every_secs": 10.0, "output": "out"},
     "--export_every_secs applies to a stream"),
    ({"keep_exports": 0}, "--keep_exports must be 1 or more. Received: 0"),
])
def test_the_stream_flags_are_checked_naming_the_flag(flags, message):
    config = _config(**{"training_data": "kafka://127.0.0.1:9/t", **flags})
    with pytest.raises(ConfigError, match=message):
        config.validate("train", check_paths=False)


def test_a_stream_job_is_checked_against_its_broker_and_topic(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("clicks", 2)
    url = f"kafka://{kafka_broker.bootstrap}/clicks"
    assert check_inputs(_config(url, stream_idle_secs=5.0)) == [(url, 0)]  # a stream counts no records
    with pytest.raises(DataError, match=r"--training_data: the topic 'missing' does not exist .*create it, or name"):
        check_inputs(_config(f"kafka://{kafka_broker.bootstrap}/missing"))
    with pytest.raises(DataError, match=r"--training_data 'kafka://nohost/clicks' is not a Kafka stream address"):
        check_inputs(_config("kafka://nohost/clicks"))
    with pytest.raises(DataError, match=r"--validation_data: kafka://.* is a Kafka stream, and --validation_data reads files"):
        check_inputs(_config(url, validation_data=url))


def test_an_unreachable_broker_exits_2_naming_the_address_and_the_flag(tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO, "--model_def", MODEL_DEF,
         "--training_data", f"kafka://{address}/clicks", "--job_name", "unreachable"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--training_data: the Kafka brokers {address} cannot be reached" in result.stderr
    assert "Traceback" not in result.stderr
