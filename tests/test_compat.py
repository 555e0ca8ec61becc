"""The original ElasticDL's conventions, piece by piece (fast, in-process): the Keras generation
read from a module's text, RecordIO files, ``model_zoo.*`` imports, the original's flags, the
older dataset_fn, nested metrics with a labels tensor, the legacy import paths."""

from __future__ import annotations

import gzip
import os
import sys
import textwrap

import numpy as np
import pytest
from zoo_helpers import restore_import_state

from elasticdl.cli.legacy_flags import strip_legacy_flags
from elasticdl.cli.parser import config_from_args
from elasticdl.config import ConfigError
from elasticdl.data import recordio
from elasticdl.data.errors import CorruptRecordError, DataError
from elasticdl.data.sources import count_records, make_shards, read_records, record_format
from elasticdl.model.keras_generation import choose, detect
from elasticdl.model.spec import ModelSpecError, load_model_spec

_restore = restore_import_state("compatzoo")


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return str(path)


# ---------------------------------------------------------------- which Keras


@pytest.mark.parametrize("text,version,why", [
    ("import tensorflow as tf\nx = tf.keras.layers.Dense(1)\n", "2", "writes tf.keras and never imports keras"),
    ("import keras\nimport tensorflow as tf\nx = tf.keras.layers.Dense(1)\n", "3", "no Keras 2 idiom"),
    ("import tf_keras\n", "2", "imports tf_keras"),
    ("import keras\nc = tf.feature_column.numeric_column('a')\n", "2", "uses feature columns"),
    ("import keras\nfrom tensorflow.python.keras import metrics\n", "2", "tensorflow.python.keras"),
    ("from tensorflow.keras import layers\n", "2", "writes tf.keras"),
    ("import keras\nfrom elasticdl.python.common.constants import Mode\n", "3", "no Keras 2 idiom"),
])
def test_keras_generation_from_the_module_text(tmp_path, text, version, why):
    path = write(tmp_path / "zoo" / "pkg" / "m.py", text)
    choice = detect(path, str(tmp_path / "zoo"))
    assert choice.version == version and why in choice.reason


def test_keras_generation_follows_model_zoo_imports_and_the_flag_wins(tmp_path):
    zoo = tmp_path / "model_zoo"
    write(zoo / "pkg" / "columns.py", "import tensorflow as tf\nCOLS = [tf.feature_column.numeric_column('a')]\n")
    write(zoo / "pkg" / "m.py", "import keras\nfrom model_zoo.pkg.columns import COLS\n")
    assert "columns.py uses feature columns" in choose("auto", str(zoo), "pkg.m.custom_model").reason
    assert choose("3", str(zoo), "pkg.m.custom_model").version == "3"
    with pytest.raises(ValueError, match="auto, 2 or 3"):
        choose("4", str(zoo), "pkg.m.custom_model")


# ---------------------------------------------------------------- RecordIO


@pytest.mark.parametrize("compressor", [recordio.NONE, recordio.SNAPPY, recordio.GZIP])
def test_recordio_counts_from_headers_and_reads_ranges_across_chunks(tmp_path, compressor):
    rng = np.random.default_rng(0)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 40, size=250)]
    path = str(tmp_path / "part-0")  # no suffix: told apart by its magic number
    recordio.write_records(path, records, compressor, records_per_chunk=64)
    assert record_format(path) == "recordio" and count_records(path) == 250
    for shard in make_shards([(path, 250)], 48):  # tasks cut on record ranges, as for TFRecord
        assert list(read_records(path, shard.start, shard.end)) == records[shard.start:shard.end]
    with pytest.raises(DataError, match="has only 250 records"):
        list(read_records(path, 240, 260))


def test_recordio_reads_real_snappy_compression(tmp_path):
    """A chunk compressed by Snappy proper (a literal, then a back-reference that overlaps itself),
    as Go's recordio writes it: framed, with the masked CRC-32C of the uncompressed bytes."""
    raw = b"".join(len(r).to_bytes(4, "little") + r for r in (b"abcabcabcabc", b"xyz"))
    # 23 bytes: a 7-byte literal (a length and "abc"), a 9-byte copy from 3 back, a 7-byte literal.
    block = bytes([len(raw), (7 - 1) << 2]) + raw[:7] + bytes([((9 - 4) << 2) | 1, 3, (7 - 1) << 2]) + raw[16:]
    assert recordio._snappy_block(block) == raw
    frame = b"\xff\x06\x00\x00sNaPpY" + bytes([0]) + (len(block) + 4).to_bytes(3, "little")
    frame += recordio._masked_crc32c(raw).to_bytes(4, "little") + block
    import struct
    import zlib

    path = tmp_path / "x.recordio"
    path.write_bytes(struct.pack("<5I", recordio.MAGIC, zlib.crc32(frame), recordio.SNAPPY, len(frame), 2) + frame)
    assert list(read_records(str(path), 0, 2)) == [b"abcabcabcabc", b"xyz"]


def test_recordio_corruption_names_the_file_and_chunk(tmp_path):
    path = str(tmp_path / "c.recordio")
    recordio.write_records(path, [b"a" * 10] * 20, recordio.GZIP, records_per_chunk=10)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # inside the second chunk's body
    open(path, "wb").write(bytes(data))
    assert count_records(path) == 20  # headers intact
    assert list(read_records(path, 0, 10)) == [b"a" * 10] * 10  # the first chunk is fine
    with pytest.raises(CorruptRecordError, match="checksum mismatch"):
        list(read_records(path, 10, 20))
    open(path, "ab").write(b"\x01\x02")
    with pytest.raises(CorruptRecordError, match="cut short"):
        count_records(path)
    assert gzip  # imported for the writer's compressor


# ---------------------------------------------------------------- the original's flags


def test_original_flags_are_accepted_with_a_warning_or_refused(caplog):
    with caplog.at_level("WARNING"):
        argv = strip_legacy_flags(["train", "--distribution_strategy", "ParameterServerStrategy",
                                   "--need_elasticdl_job_service=true", "--log_loss_steps", "10", "--num_ps", "2"])
    assert argv == ["train", "--num_ps", "2"]
    assert "ignoring --distribution_strategy" in caplog.text and "--log_loss_steps" in caplog.text
    with pytest.raises(ConfigError, match="AllreduceStrategy is not supported.*--num_ps"):
        strip_legacy_flags(["train", "--distribution_strategy=AllreduceStrategy"])
    _, config = config_from_args(["train", "--model_zoo", "z", "--model_def", "a.b.c", "--feed", "my_feed",
                                  "--loss", "my_loss", "--keras_version", "2", "--need_elasticdl_job_service"])
    assert config.model_zoo_functions.names()["dataset_fn"] == "my_feed"
    assert config.model_zoo_functions.keras_version == "2"


# ---------------------------------------------------------------- loading the module


MODULE = """\
import keras
import tensorflow as tf

def custom_model():
    return keras.Sequential([keras.layers.Dense(1)])

def my_loss(labels, predictions):
    return tf.reduce_mean(predictions)

def optimizer(lr=0.1):
    return keras.optimizers.SGD(lr)

def feed(dataset, mode):
    return dataset
"""


def test_function_name_flags_and_the_older_two_argument_feed(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "compatzoo_a" / "m.py", MODULE)
    with pytest.raises(ModelSpecError, match=r"missing `loss`"):
        load_model_spec(str(zoo), "compatzoo_a.m.custom_model")
    spec = load_model_spec(str(zoo), "compatzoo_a.m.custom_model", {"loss": "my_loss"})
    assert spec.loss.__wrapped__.__name__ == "my_loss"
    assert spec.dataset_fn("ds", "training", None) == "ds"  # feed(dataset, mode): no metadata
    with pytest.raises(ModelSpecError, match=r"missing `nope` \(named by --feed\)"):
        load_model_spec(str(zoo), "compatzoo_a.m.custom_model", {"loss": "my_loss", "dataset_fn": "nope"})


def test_custom_data_reader_is_refused_with_the_alternative(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "compatzoo_b" / "m.py", MODULE.replace("my_loss", "loss") + "\ndef custom_data_reader(**kw):\n    pass\n")
    with pytest.raises(ModelSpecError, match="custom data reader.*TFRecord, CSV, RecordIO"):
        load_model_spec(str(zoo), "compatzoo_b.m.custom_model")


def test_model_zoo_imports_resolve_without_shadowing_installed_packages(tmp_path, monkeypatch):
    installed = tmp_path / "site"
    write(installed / "compatzoo_json_like" / "__init__.py", "WHO = 'installed'\n")
    monkeypatch.syspath_prepend(str(installed))
    zoo = tmp_path / "my_zoo"
    write(zoo / "compatzoo_json_like" / "__init__.py", "WHO = 'zoo'\n")  # same name as the installed one
    write(zoo / "compatzoo_c" / "helpers.py", "HELPED = True\n")
    write(zoo / "compatzoo_c" / "m.py", MODULE.replace("my_loss", "loss")
          + "from model_zoo.compatzoo_c.helpers import HELPED\nimport compatzoo_json_like\n")
    monkeypatch.delitem(sys.modules, "model_zoo", raising=False)
    spec = load_model_spec(str(zoo), "compatzoo_c.m.custom_model")
    module = sys.modules["compatzoo_c.m"]
    assert module.HELPED is True
    assert module.compatzoo_json_like.WHO == "installed"  # the zoo went to the end of sys.path
    assert spec.module_path.startswith(str(zoo))
    sys.modules.pop("model_zoo", None)


# ---------------------------------------------------------------- metrics, legacy paths


def test_nested_metrics_get_the_labels_tensor_for_each_output():
    import keras
    import tensorflow as tf

    from elasticdl.model.metrics import MetricsAccumulator

    labels = tf.constant([1, 0, 1, 1])
    predictions = {"logits": tf.constant([2.0, -1.0, -3.0, 0.5]), "probs": tf.constant([0.9, 0.2, 0.1, 0.6])}
    accumulator = MetricsAccumulator({
        "logits": {"accuracy": lambda y, p: tf.equal(tf.cast(p > 0, tf.int32), y)},
        "probs": {"auc": keras.metrics.AUC()},
    })
    accumulator.update(labels, predictions)
    result = accumulator.result()
    assert result["logits/accuracy"] == pytest.approx(0.75)
    assert result["probs/auc"] == pytest.approx(2 / 3, abs=1e-3)  # positives 0.9, 0.1, 0.6 against 0.2


def test_legacy_import_paths():
    import elasticdl.layers
    from elasticdl.callbacks import LearningRateScheduler as Ours
    from elasticdl.python.common.log_utils import default_logger
    from elasticdl.python.elasticdl.callbacks import LearningRateScheduler
    from elasticdl.python.elasticdl.layers.embedding import Embedding
    from elasticdl.python.worker.prediction_outputs_processor import BasePredictionOutputsProcessor

    assert LearningRateScheduler is Ours
    assert Embedding is elasticdl.layers.Embedding  # Keras 3 in this process
    assert default_logger.name.startswith("elasticdl")
    with pytest.raises(TypeError):
        BasePredictionOutputsProcessor()  # process() is abstract


def test_keras_2_cannot_be_chosen_after_tensorflow_was_imported_with_keras_3(monkeypatch):
    import importlib.util

    import tensorflow  # noqa: F401  (this process imported it with Keras 3)

    from elasticdl.model.keras_generation import KerasVersionError, activate

    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    with pytest.raises(KerasVersionError, match="set TF_USE_LEGACY_KERAS=1 in the environment before importing"):
        activate("2")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else real(name, *a))
    with pytest.raises(KerasVersionError, match=r"pip install --no-deps 'tf-keras~=\d+\.\d+\.0'"):
        activate("2")
    activate("3")  # what this process runs: fine
    assert os.environ["TF_USE_LEGACY_KERAS"] == "0"
