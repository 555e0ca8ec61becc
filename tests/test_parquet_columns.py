"""Parquet rows as column tensors (--data_reader_params records=columns), and read-ahead."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticdl.data import parquet
from elasticdl.data.columns import ColumnStream, _column, from_arrow, select
from elasticdl.data.errors import CorruptRecordError, DataError
from elasticdl.data.read_ahead import read_ahead
from elasticdl.data.sources import read_columns, stream_columns
from elasticdl.mode import Mode
from elasticdl.model.spec import DatasetMetadata, ModelSpec
from elasticdl.worker.task_data import BatchStream

ROWS = 50


def _table() -> pa.Table:
    return pa.table({
        "id": pa.array(np.arange(ROWS, dtype=np.int32)),  # int32 in the file, int64 as a tensor
        "tags": pa.array([[i, i + 1000][: i % 3] if i % 7 else None for i in range(ROWS)], pa.list_(pa.int64())),
        "user": pa.array([{"age": i / 2, "city": f"c{i}"} for i in range(ROWS)]),
        "label": pa.array([i % 2 == 1 for i in range(ROWS)]),
    })


def _tags(i: int) -> list[int]:
    return [i, i + 1000][: i % 3] if i % 7 else []


@pytest.fixture
def data(tmp_path):
    path = str(tmp_path / "rows.parquet")
    pq.write_table(_table(), path, row_group_size=16)  # a task of rows 5-44 spans three row groups
    return path


def test_columns_of_a_row_range_across_row_groups(data):
    records = read_columns(data, 5, 45)
    assert len(records) == 40 and records.names == ("id", "tags", "user.age", "user.city", "label")
    assert records.layout == (("id", "int64", False), ("tags", "int64", True), ("user.age", "float32", False),
                              ("user.city", "string", False), ("label", "int64", False))
    ids, tags = records.columns[0], records.columns[1]
    assert ids.values.tolist() == list(range(5, 45))
    assert [tags.values[a:b].tolist() for a, b in zip(tags.offsets[:-1], tags.offsets[1:])] == [
        _tags(i) for i in range(5, 45)]  # a null list is an empty one
    kept = select(records, [0, 2, 39])
    assert kept.columns[0].values.tolist() == [5, 7, 44]
    assert [kept.columns[1].values[a:b].tolist() for a, b in zip(kept.columns[1].offsets[:-1],
                                                                 kept.columns[1].offsets[1:])] == [_tags(5), _tags(7), _tags(44)]
    assert len(read_columns(data, 3, 3)) == 0


def test_dataset_fn_gets_a_dict_of_column_tensors_per_row(data):
    seen = {}

    def dataset_fn(dataset, mode, metadata):
        seen["spec"], seen["metadata"] = dataset.element_spec, metadata

        def parse(row):
            tags = tf.concat([row["tags"], tf.fill([2 - tf.size(row["tags"])], tf.constant(-1, tf.int64))], 0)
            features = {"id": row["id"], "tags": tf.ensure_shape(tags, [2]), "age": row["user.age"],
                        "city": row["user.city"]}
            return features, row["label"]
        return dataset.map(parse)

    metadata = DatasetMetadata("parquet", ("id", "tags", "user.age", "user.city", "label"))
    stream = BatchStream(ModelSpec("zoo/m.py", "custom_model", None, None, None, dataset_fn), Mode.TRAINING,
                         metadata, batch_size=16)
    first = [(b, done) for b, done in stream.batches(read_columns(data, 5, 45))]
    iterator = stream._iterator
    second = [(b, done) for b, done in stream.batches(read_columns(data, 45, 50))]
    assert stream._iterator is iterator  # one long-lived pipeline for task after task
    spec = seen["spec"]
    assert spec["id"].shape == [] and spec["id"].dtype == tf.int64
    assert spec["user.age"].dtype == tf.float32 and spec["user.city"].dtype == tf.string
    assert spec["tags"].shape.as_list() == [None] and spec["tags"].dtype == tf.int64  # a row's list: 1-D
    assert seen["metadata"].column_names == metadata.column_names
    assert [done for _, done in first] == [16, 32, 40] and [done for _, done in second] == [5]
    features = {k: np.concatenate([b[0][k].numpy() for b, _ in first + second]) for k in ("id", "tags", "age", "city")}
    assert features["id"].tolist() == list(range(5, 50))
    assert features["tags"].tolist() == [(_tags(i) + [-1, -1])[:2] for i in range(5, 50)]
    assert features["age"].tolist() == [i / 2 for i in range(5, 50)]
    assert features["city"].tolist() == [f"c{i}".encode() for i in range(5, 50)]
    assert np.concatenate([b[1].numpy() for b, _ in first + second]).tolist() == [i % 2 for i in range(5, 50)]
    stream.close()


def test_a_list_column_left_ragged_batches_as_a_ragged_tensor(data):
    stream = BatchStream(ModelSpec("zoo/m.py", "custom_model", None, None, None, lambda d, m, md: d),
                         Mode.PREDICTION, DatasetMetadata("parquet"), batch_size=8)
    batch, done = next(iter(stream.batches(read_columns(data, 0, 8))))
    assert isinstance(batch["tags"], tf.RaggedTensor) and batch["tags"].to_list() == [_tags(i) for i in range(8)]
    assert done == 8
    stream.close()


def test_a_null_in_a_scalar_column_is_named(tmp_path):
    path = str(tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"price": pa.array([1.0, None, 3.0])}), path)
    with pytest.raises(DataError, match=r"column 'price' is null in row 1.*records=examples"):
        read_columns(path, 0, 3)


def test_columns_of_other_formats_are_refused_at_submit(tmp_path):
    from elasticdl.config import ConfigError, JobConfig
    from elasticdl.master.preflight import check_inputs

    path = tmp_path / "rows.csv"
    path.write_text("1\n2\n")
    (tmp_path / "zoo" / "m").mkdir(parents=True)
    (tmp_path / "zoo" / "m" / "model.py").write_text("def custom_model():\n    pass\n")
    flags = {"model_zoo": str(tmp_path / "zoo"), "model_def": "m.model.custom_model", "training_data": str(path)}
    with pytest.raises(DataError, match=r"rows.csv: --data_reader_params records=columns reads Parquet files"):
        check_inputs(JobConfig.from_flags(**flags, data_reader_params="records=columns"), "train")
    with pytest.raises(DataError, match="records=columns reads Parquet files"):
        read_columns(str(path), 0, 2)
    with pytest.raises(ConfigError, match="records='rows'.*records=examples.*records=columns"):
        JobConfig.from_flags(**flags, data_reader_params="records=rows").data.records  # noqa: B018


def test_read_ahead_keeps_order_and_stays_one_ahead():
    taken = []

    def source():
        for i in range(5):
            taken.append(i)
            yield i

    items = read_ahead(source())
    got = []
    for item in items:
        got.append(item)
        assert len(taken) <= item + 3  # this one, one handed over, one being fetched: no more
    assert got == [0, 1, 2, 3, 4] and taken == got


def _stream(dataset_fn=lambda d, m, md: d.map(lambda row: (row["id"], row["label"]))):
    return BatchStream(ModelSpec("zoo/m.py", "custom_model", None, None, None, dataset_fn), Mode.TRAINING,
                       DatasetMetadata("parquet"), batch_size=8)


def test_a_streamed_task_trains_the_same_rows_in_the_same_order(data):
    stream = _stream()
    direct = [(b[0].numpy().tolist(), done) for b, done in stream.batches(read_columns(data, 5, 45))]
    streamed_records = stream_columns(data, 5, 45)  # row groups of 11, 16 and 13 rows of the range
    assert isinstance(streamed_records, ColumnStream) and len(streamed_records) == 40
    streamed = [(b[0].numpy().tolist(), done) for b, done in stream.batches(streamed_records)]
    assert streamed == direct
    assert [ids for ids, _ in streamed] == [list(range(a, min(a + 8, 45))) for a in range(5, 45, 8)]
    assert [done for _, done in streamed] == [8, 16, 24, 32, 40]
    assert streamed_records.take([0, 39]).columns[0].values.tolist() == [5, 44]  # all rows, once arrived
    stream.close()


def _damaged(data: str, path: str) -> str:
    with open(data, "rb") as f:
        whole = f.read()
    # The footer intact, the pages of the second and third row groups zeroed.
    meta = pq.ParquetFile(data).metadata
    columns = [meta.row_group(g).column(c) for g in (1, 2) for c in range(meta.num_columns)]
    lo = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
    hi = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size for c in columns)
    with open(path, "wb") as f:
        f.write(whole[:lo] + b"\0" * (hi - lo) + whole[hi:])
    return path


def test_a_failed_read_ahead_fails_the_task_as_a_direct_read_does(data, tmp_path):
    damaged = _damaged(data, str(tmp_path / "damaged.parquet"))
    with pytest.raises(CorruptRecordError) as direct:
        read_columns(damaged, 5, 45)
    stream = _stream()
    trained = []
    records = stream_columns(damaged, 5, 45)
    with pytest.raises(CorruptRecordError) as streamed:
        for _batch, done in stream.batches(records):
            trained.append(done)
    assert str(streamed.value) == str(direct.value) and "rows [5, 45) cannot be read" in str(direct.value)
    # Chunks are fed two ahead of training, and the second needs the damaged row group.
    assert trained == []
    with pytest.raises(CorruptRecordError):  # the rows that arrived are never taken for all of them
        records[0:8]
    stream.close()


def test_a_failed_read_ahead_raises_what_a_direct_read_raises(data, tmp_path):
    truncated = str(tmp_path / "truncated.parquet")
    _damaged(data, truncated)
    direct = []
    with pytest.raises(Exception) as direct_err:
        for table in parquet._row_group_tables(truncated, 5, 45, None):
            direct.append(table.num_rows)
    with pytest.raises(CorruptRecordError) as ahead_err:
        read_columns(truncated, 5, 45)
    assert type(ahead_err.value) is type(direct_err.value)
    assert str(ahead_err.value) == str(direct_err.value)
    assert "rows [5, 45) cannot be read" in str(ahead_err.value)
    ahead = []
    with pytest.raises(type(direct_err.value)):
        for table in read_ahead(parquet._row_group_tables(truncated, 5, 45, None)):
            ahead.append(table.num_rows)
    assert ahead == direct == [11]  # the rows before the failure, then the same error


def test_a_bad_row_among_columns_is_found_by_bisection(data):
    from elasticdl.model.records import find_bad_records
    from elasticdl.model.trainer import make_dataset

    def refuse_13(rows):
        spec = ModelSpec("zoo/m.py", "custom_model", None, None, None,
                         lambda d, m, md: d.map(lambda row: tf.ensure_shape(
                             tf.debugging.check_numerics(1.0 / tf.cast(row["id"] - 13, tf.float32), "row 13"), [])))
        for _ in make_dataset(spec, rows, Mode.TRAINING, DatasetMetadata("parquet"), len(rows)):
            pass

    records = read_columns(data, 5, 45)
    found = find_bad_records(records, refuse_13)
    assert [i for i, _ in found] == [8] and "row 13" in found[0][1]  # row 13 is the 9th of 5..44
    kept = select(records, [i for i in range(len(records)) if i != 8])
    assert 13 not in kept.columns[0].values.tolist() and len(kept) == 39


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.one_of(st.none(), st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=3)),
                     min_size=1, max_size=40),
       cut=st.tuples(st.integers(0, 40), st.integers(0, 40)), size=st.integers(1, 9))
def test_chunks_of_list_columns_are_the_rows_cut_in_order(rows, cut, size):
    """Nested lists, nulls or none, a sliced table (its lists' offsets not at 0), any chunk size:
    each chunk's components are its rows' values, as the rows themselves say."""
    table = pa.table({"id": pa.array(range(len(rows)), pa.int64()),
                      "ids": pa.array(rows, pa.list_(pa.list_(pa.int64())))})
    lo, hi = sorted(min(c, len(rows)) for c in cut)
    records = from_arrow(table.slice(lo, hi - lo))
    flat = [[v for inner in (row or []) for v in (inner or [])] for row in rows[lo:hi]]
    chunks = records.chunks(size)
    assert len(chunks) == -(-(hi - lo) // size)
    for k, (ids, values, offsets) in enumerate(chunks):
        expected = flat[k * size:(k + 1) * size]
        assert ids.tolist() == list(range(lo + k * size, lo + k * size + len(expected)))
        assert offsets[0] == 0 and len(offsets) == len(expected) + 1
        assert [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == expected
    # An array sliced as Arrow slices it (from_arrow's tables come whole): offsets rebased to 0.
    sliced = _column("ids", table.column("ids").chunk(0).slice(lo, hi - lo))
    assert sliced.offsets[0] == 0 and len(sliced) == hi - lo
    assert [sliced.values[a:b].tolist() for a, b in zip(sliced.offsets[:-1], sliced.offsets[1:])] == flat
