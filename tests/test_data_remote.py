"""Parquet records and remote paths (elasticdl/fs/__init__.py) against moto's S3 server, through s3fs."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticdl import fs
from elasticdl.config import ConfigError, check_writable_dir
from elasticdl.data import CorruptRecordError, DataError
from elasticdl.data.sources import check_parquet_schemas, count_records, read_records, resolve_data_files
from elasticdl.data.tfrecord import write_records
from elasticdl.model import checkpoint


def _table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, n))]).astype(np.int32)
    return pa.table({
        "user": pa.array(rng.integers(0, 10**12, n)),  # high cardinality, multi-byte varints
        "price": pa.array(rng.random(n).astype(np.float32)),
        "tags": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1000, int(offsets[-1])))),
        "city": pa.array([f"city-{i % 7}" for i in range(n)]),
        "geo": pa.array([{"lat": float(i), "zone": i % 3} for i in range(n)]),
        "label": pa.array(rng.integers(0, 2, n)),
    })


def _parquet_bytes(table: pa.Table, row_group_rows: int = 100) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=row_group_rows)
    return out.getvalue()


def _parse(records: list[bytes]) -> dict:
    """The records parsed as tf.train.Example, in one call, as numpy (``tags`` as lists)."""
    import tensorflow as tf

    spec = {
        "user": tf.io.FixedLenFeature([1], tf.int64), "price": tf.io.FixedLenFeature([1], tf.float32),
        "tags": tf.io.RaggedFeature(tf.int64), "city": tf.io.FixedLenFeature([1], tf.string),
        "geo.lat": tf.io.FixedLenFeature([1], tf.float32), "geo.zone": tf.io.FixedLenFeature([1], tf.int64),
        "label": tf.io.FixedLenFeature([1], tf.int64),
    }
    parsed = tf.io.parse_example(tf.constant(records), spec)
    return {k: v.to_list() if k == "tags" else v.numpy()[:, 0] for k, v in parsed.items()}


def test_parquet_rows_parse_like_tfrecord_examples_with_lists_and_structs(tmp_path):
    table = _table(250)
    path = str(tmp_path / "part.parquet")
    pq.write_table(table, path, row_group_size=100)
    assert count_records(path) == 250
    records = list(read_records(path, 95, 205))  # crosses two row-group boundaries
    assert len(records) == 110
    expected = table.slice(95, 110).to_pydict()
    parsed = _parse(records)
    assert parsed["user"].tolist() == expected["user"]
    np.testing.assert_allclose(parsed["price"], expected["price"])
    assert parsed["tags"] == expected["tags"]  # multi-hot lists, empty ones too
    assert [c.decode() for c in parsed["city"]] == expected["city"]
    assert parsed["geo.lat"].tolist() == [g["lat"] for g in expected["geo"]]
    assert parsed["geo.zone"].tolist() == [g["zone"] for g in expected["geo"]]


def test_parquet_column_projection_and_counting_from_the_footer_only(tmp_path):
    import tensorflow as tf

    data = bytearray(_parquet_bytes(_table(300)))
    footer = int.from_bytes(data[-8:-4], "little") + 8
    path = tmp_path / "damaged.parquet"
    data[4:len(data) - footer] = b"\xff" * (len(data) - footer - 4)  # every data page destroyed
    path.write_bytes(bytes(data))
    assert count_records(str(path)) == 300  # the footer alone
    with pytest.raises(CorruptRecordError, match="damaged.parquet"):
        list(read_records(str(path), 0, 10))
    good = tmp_path / "good.parquet"
    good.write_bytes(_parquet_bytes(_table(300)))
    (record,) = read_records(str(good), 7, 8, columns=["tags", "label"])
    assert set(tf.train.Example.FromString(record).features.feature) == {"tags", "label"}


def test_parquet_schema_mismatch_is_named_at_submit_time(tmp_path):
    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(_table(10), a)
    pq.write_table(_table(10).set_column(1, "price", pa.array(["x"] * 10)), b)
    with pytest.raises(DataError, match=r"column 'price' is string in .*b\.parquet but float in .*a\.parquet"):
        check_parquet_schemas([a, b])
    check_parquet_schemas([a, b], columns=["user", "tags"])  # the projected columns agree
    with pytest.raises(DataError, match=r"no column 'clicks'.*the file has user, price"):
        check_parquet_schemas([a], columns=["user", "clicks"])
    pq.write_table(pa.table({"m": pa.array([{"k": 1}], pa.map_(pa.string(), pa.int64()))}), b)
    with pytest.raises(DataError, match=r"b\.parquet: column 'm' has type map<string, int64.*no tf.train.Example feature holds"):
        check_parquet_schemas([b])


def test_data_and_checkpoints_in_a_bucket(s3_env, tmp_path):
    bucket = s3_env.new_bucket()
    s3 = s3_env.filesystem()
    table = _table(120)
    s3.pipe_file(f"{bucket}/data/part-0.parquet", _parquet_bytes(table, 50))
    local_tf = tmp_path / "x.tfrecord"
    write_records(local_tf, [b"r%d" % i for i in range(30)])
    s3.put_file(str(local_tf), f"{bucket}/data/part-1.tfrecord")
    s3.pipe_file(f"{bucket}/data/part-2.csv", b"a,1\nb,2\nc,3\n")
    s3.pipe_file(f"{bucket}/data/.hidden", b"")
    files = resolve_data_files(f"s3://{bucket}/data")  # a directory, as locally
    assert files == [f"s3://{bucket}/data/part-{i}.{x}" for i, x in enumerate(("parquet", "tfrecord", "csv"))]
    assert resolve_data_files(f"s3://{bucket}/data/*.csv") == files[2:]
    assert [count_records(f) for f in files] == [120, 30, 3]
    assert list(read_records(files[1], 28, 30)) == [b"r28", b"r29"]
    assert list(read_records(files[2], 1, 3)) == [b"b,2", b"c,3"]
    assert _parse(list(read_records(files[0], 48, 52)))["user"].tolist() == table["user"].to_pylist()[48:52]

    state = checkpoint.ShardState(version=7, step=7, params={"w": np.arange(4.0)}, slots={})
    directory = f"s3://{bucket}/ckpt"
    checkpoint.save_shard(directory, 0, 1, state)
    assert s3.exists(f"{bucket}/ckpt/version-7/ps-0-of-1.npz.committed")
    # A shard without its marker (a writer that died between the put and the commit) does not count.
    s3.pipe_file(f"{bucket}/ckpt/version-9/ps-0-of-1.npz", b"partial")
    assert checkpoint.complete_versions(directory) == [7]
    assert checkpoint.resolve_checkpoint(directory) == f"{directory}/version-7"
    np.testing.assert_array_equal(checkpoint.load_shard(directory, 0, 1).params["w"], np.arange(4.0))
    for version in (8, 10):
        checkpoint.save_shard(directory, 0, 1, checkpoint.ShardState(version, version, {"w": np.zeros(2)}, {}))
    checkpoint.prune(directory, 2)
    assert checkpoint.complete_versions(directory) == [8, 10]


def test_bad_remote_input_fails_clearly(s3_env, monkeypatch):
    import s3fs

    with pytest.raises(fs.StorageError, match=r"bucket 'no-such-bucket' does not exist"):
        resolve_data_files("s3://no-such-bucket/train")
    with pytest.raises(ConfigError, match=r"--checkpoint_dir s3://no-such-bucket/ckpt: bucket 'no-such-bucket'"):
        check_writable_dir("--checkpoint_dir", "s3://no-such-bucket/ckpt")
    bucket = s3_env.new_bucket()
    s3 = s3_env.filesystem()
    whole = _parquet_bytes(_table(200))
    s3.pipe_file(f"{bucket}/cut.parquet", whole[: len(whole) // 2])  # an upload cut short
    with pytest.raises(CorruptRecordError, match=r"s3://.*/cut\.parquet: .*not a readable Parquet file"):
        count_records(f"s3://{bucket}/cut.parquet")
    s3.pipe_file(f"{bucket}/cut.tfrecord", _tfrecord_bytes()[:-7])
    with pytest.raises(CorruptRecordError, match=r"cut\.tfrecord: record 2 .*runs past end of file"):
        count_records(f"s3://{bucket}/cut.tfrecord")

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(fs.StorageError, match=r"no credentials for s3://.*AWS_ACCESS_KEY_ID.*--envs"):
        resolve_data_files(f"s3://{bucket}/cut.parquet")


def _tfrecord_bytes() -> bytes:
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        write_records(f.name, [b"a" * 10, b"b" * 10, b"c" * 10])
        return open(f.name, "rb").read()


def test_prediction_outputs_and_tensorboard_logs_in_a_bucket(s3_env):
    from elasticdl.data.sources import Shard
    from elasticdl.master.tensorboard import TensorBoardWriter
    from elasticdl.model import prediction

    bucket = s3_env.new_bucket()
    s3 = s3_env.filesystem()
    outputs = f"s3://{bucket}/predictions"
    shards = [Shard("s3://data/a.parquet", 0, 2), Shard("s3://data/a.parquet", 2, 3)]
    assert prediction.write_part(outputs, shards[1].path, 2, [np.array([[0.5]])]) == 1
    assert prediction.write_part(outputs, shards[0].path, 0, [np.array([[0.25], [0.75]])]) == 2
    assert prediction.join_parts(outputs, shards) == f"{outputs}/predictions.csv"
    assert s3.cat_file(f"{bucket}/predictions/predictions.csv").decode().split() == ["output_0", "0.25", "0.75", "0.5"]
    assert not s3.exists(f"{bucket}/predictions/parts")

    writer = TensorBoardWriter(f"s3://{bucket}/tb")
    writer.scalars(1, {"loss": 0.5})
    writer.close()
    (events,) = [p for p in s3.ls(f"{bucket}/tb") if not p.endswith(".committed")]
    assert "tfevents" in events and s3.size(events) > 0
