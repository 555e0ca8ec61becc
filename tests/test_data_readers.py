"""Tests for elasticdl.data: TFRecord/CSV readers, file resolution, shards."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticdl.data import (
    CorruptRecordError,
    DataError,
    NoDataFilesError,
    Shard,
    count_records,
    csv_file,
    make_shards,
    read_records,
    record_format,
    resolve_data_files,
    tfrecord,
    write_records,
)


def _records(n: int) -> list[bytes]:
    # Varied lengths, including empty and > 64 KiB (one buffer), so header
    # walking crosses buffer boundaries and handles zero-length bodies.
    out = []
    for i in range(n):
        size = 0 if i % 7 == 0 else (70_000 if i == 5 else i * 13 % 300)
        out.append(bytes((i + j) % 256 for j in range(size)))
    return out


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


@pytest.fixture
def tf_written(tmp_path: Path, tf) -> tuple[str, list[bytes]]:
    """A TFRecord file written by TensorFlow itself."""
    recs = _records(40)
    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for r in recs:
            writer.write(r)
    return path, recs


# --- TFRecord -------------------------------------------------------------


def test_tensorflow_file_counted(tf_written):
    path, recs = tf_written
    assert count_records(path) == len(recs)
    assert tfrecord.count_records(path) == len(recs)


@pytest.mark.parametrize(
    "start,end", [(0, 40), (0, 3), (17, 23), (35, 40), (39, 40), (5, 6), (12, 12)]
)
def test_tensorflow_file_ranges(tf_written, start, end):
    path, recs = tf_written
    assert list(read_records(path, start, end)) == recs[start:end]


def test_our_file_read_by_tensorflow(tmp_path, tf):
    recs = _records(30)
    path = str(tmp_path / "ours.rec")
    assert write_records(path, recs) == len(recs)
    got = [t.numpy() for t in tf.data.TFRecordDataset(path)]
    assert got == recs
    assert list(read_records(path, 0, 30)) == recs


def test_empty_file(tmp_path):
    path = str(tmp_path / "empty.rec")
    write_records(path, [])
    assert count_records(path) == 0
    assert list(read_records(path, 0, 0)) == []


def test_end_past_file_names_file_and_count(tmp_path):
    path = str(tmp_path / "short.rec")
    write_records(path, _records(4))
    with pytest.raises(DataError, match=r"short\.rec.*only 4 records"):
        list(read_records(path, 2, 9))
    with pytest.raises(DataError, match="only 4 records"):
        list(read_records(path, 6, 9))


def test_invalid_range_raises_at_call(tmp_path):
    path = str(tmp_path / "x.rec")
    write_records(path, _records(3))
    with pytest.raises(ValueError):
        read_records(path, 2, 1)
    with pytest.raises(ValueError):
        read_records(path, -1, 1)


def _offset_of(recs: list[bytes], index: int) -> int:
    return sum(12 + len(r) + 4 for r in recs[:index])


def test_truncated_file(tmp_path):
    recs = _records(10)
    path = tmp_path / "trunc.rec"
    write_records(str(path), recs)
    data = path.read_bytes()
    path.write_bytes(data[: _offset_of(recs, 9) + 12 + 3])  # mid-body of #9
    with pytest.raises(CorruptRecordError, match=r"trunc\.rec: record 9 at byte"):
        count_records(str(path))
    with pytest.raises(CorruptRecordError, match="record 9"):
        list(read_records(str(path), 0, 10))
    # Records before the damage are still readable.
    assert list(read_records(str(path), 0, 9)) == recs[:9]
    # A header cut short is reported too.
    path.write_bytes(data[: _offset_of(recs, 4) + 5])
    with pytest.raises(CorruptRecordError, match="record 4"):
        count_records(str(path))


def test_flipped_byte_in_body(tmp_path):
    recs = _records(10)
    path = tmp_path / "body.rec"
    write_records(str(path), recs)
    data = bytearray(path.read_bytes())
    offset = _offset_of(recs, 6)
    data[offset + 12 + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    # Counting never reads bodies, so it cannot see this damage.
    assert count_records(str(path)) == 10
    with pytest.raises(CorruptRecordError) as err:
        list(read_records(str(path), 3, 8))
    msg = str(err.value)
    assert "body.rec" in msg and f"record 6 at byte {offset}" in msg
    assert "data CRC mismatch" in msg and "--training_data" in msg
    assert err.value.index == 6 and err.value.offset == offset
    # Ranges that skip the damaged record are unaffected.
    assert list(read_records(str(path), 7, 10)) == recs[7:]


def test_flipped_byte_in_length_header(tmp_path):
    recs = _records(10)
    path = tmp_path / "hdr.rec"
    write_records(str(path), recs)
    data = bytearray(path.read_bytes())
    offset = _offset_of(recs, 3)
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    for call in (
        lambda: count_records(str(path)),
        lambda: list(read_records(str(path), 0, 2 + 3)),
        lambda: list(read_records(str(path), 8, 9)),  # skipping walks it too
    ):
        with pytest.raises(
            CorruptRecordError, match=rf"hdr\.rec: record 3 at byte {offset}"
        ):
            call()


# --- CSV ------------------------------------------------------------------


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_csv_without_header(tmp_path, trailing_newline):
    lines = [b"1,2,3", b"4,5,6", b"", b"7,8,9"]
    body = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    path = tmp_path / "d.csv"
    path.write_bytes(body)
    assert count_records(str(path)) == 4
    assert list(read_records(str(path), 0, 4)) == lines
    assert list(read_records(str(path), 1, 3)) == lines[1:3]
    assert list(read_records(str(path), 3, 4)) == lines[3:]
    assert list(read_records(str(path), 2, 2)) == []
    with pytest.raises(DataError, match=r"d\.csv.*only 4 records"):
        list(read_records(str(path), 2, 5))


def test_csv_with_header_and_crlf(tmp_path):
    path = tmp_path / "h.CSV"
    path.write_bytes(b"a,b\r\n1,2\r\n3,4\r\n5,6")
    assert record_format(str(path)) == "csv"
    assert count_records(str(path), has_header=True) == 3
    assert count_records(str(path)) == 4
    assert list(read_records(str(path), 0, 3, has_header=True)) == [
        b"1,2",
        b"3,4",
        b"5,6",
    ]
    assert list(read_records(str(path), 2, 3, has_header=True)) == [b"5,6"]
    assert list(read_records(str(path), 0, 1)) == [b"a,b"]
    with pytest.raises(DataError, match="only 3 records after its header"):
        list(read_records(str(path), 0, 4, has_header=True))


def test_csv_empty_and_header_only(tmp_path):
    empty = tmp_path / "e.txt"
    empty.write_bytes(b"")
    assert count_records(str(empty)) == 0
    assert count_records(str(empty), has_header=True) == 0
    header_only = tmp_path / "ho.csv"
    header_only.write_bytes(b"a,b\n")
    assert count_records(str(header_only), has_header=True) == 0
    with pytest.raises(DataError, match="only 0 records"):
        list(read_records(str(header_only), 0, 1, has_header=True))


def test_csv_module_chunk_boundaries(tmp_path, monkeypatch):
    # Small chunks make newlines fall on chunk edges.
    monkeypatch.setattr(csv_file, "_CHUNK", 3)
    path = tmp_path / "c.txt"
    path.write_bytes(b"ab\ncd\nef")
    assert csv_file.count_records(str(path)) == 3
    path.write_bytes(b"ab\ncd\n")
    assert csv_file.count_records(str(path)) == 2


def test_record_format():
    assert record_format("x/a.csv") == "csv"
    assert record_format("x/a.TXT") == "csv"
    assert record_format("x/a.tfrecord") == "tfrecord"
    assert record_format("x/data-00001") == "tfrecord"


# --- resolve_data_files ---------------------------------------------------


@pytest.fixture
def data_tree(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for name in ("b.rec", "a.rec", "c.csv", ".hidden"):
        (d / name).write_bytes(b"")
    (d / "sub").mkdir()
    (d / "sub" / "z.rec").write_bytes(b"")
    return d


def test_resolve_file(data_tree):
    f = str(data_tree / "a.rec")
    assert resolve_data_files(f) == [f]


def test_resolve_dir_sorted_no_hidden_no_subdirs(data_tree):
    assert resolve_data_files(str(data_tree)) == [
        str(data_tree / n) for n in ("a.rec", "b.rec", "c.csv")
    ]


def test_resolve_glob(data_tree):
    assert resolve_data_files(str(data_tree / "*.rec")) == [
        str(data_tree / "a.rec"),
        str(data_tree / "b.rec"),
    ]


def test_resolve_comma_list_dedups(data_tree):
    spec = f"{data_tree / 'c.csv'}, {data_tree / '*.rec'},{data_tree / 'a.rec'},"
    assert resolve_data_files(spec) == [
        str(data_tree / n) for n in ("c.csv", "a.rec", "b.rec")
    ]


def test_resolve_missing(data_tree):
    missing = str(data_tree / "nope.rec")
    with pytest.raises(NoDataFilesError, match=r"nope\.rec.*check that the path"):
        resolve_data_files(missing)
    with pytest.raises(NoDataFilesError, match=r"\*\.parquet"):
        resolve_data_files(str(data_tree / "*.parquet"))
    # One bad element in a list fails the whole spec.
    with pytest.raises(NoDataFilesError, match="nope"):
        resolve_data_files(f"{data_tree / 'a.rec'},{missing}")
    empty = data_tree / "empty_dir"
    empty.mkdir()
    with pytest.raises(NoDataFilesError):
        resolve_data_files(str(empty))
    with pytest.raises(NoDataFilesError):
        resolve_data_files(" , ")


# --- shards ---------------------------------------------------------------


def test_make_shards_example():
    assert make_shards([("a", 5), ("b", 0), ("c", 2)], 2) == [
        Shard("a", 0, 2),
        Shard("a", 2, 4),
        Shard("a", 4, 5),
        Shard("c", 0, 2),
    ]
    assert Shard("a", 4, 9).records == 5
    with pytest.raises(ValueError):
        make_shards([("a", 5)], 0)
    with pytest.raises(ValueError):
        Shard("a", 3, 2)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(min_value=0, max_value=500), max_size=8),
    per_task=st.integers(min_value=1, max_value=600),
)
def test_make_shards_covers_every_record_once(counts, per_task):
    files = [(f"f{i}", n) for i, n in enumerate(counts)]
    shards = make_shards(files, per_task)
    covered = [(s.path, r) for s in shards for r in range(s.start, s.end)]
    expected = [(p, r) for p, n in files for r in range(n)]
    assert covered == expected  # every record once, in file order
    assert all(1 <= s.records <= per_task for s in shards)
    # Only a file's last shard may be short.
    for a, b in itertools.pairwise(shards):
        if a.path == b.path:
            assert a.records == per_task and a.end == b.start


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), max_size=30),
    per_task=st.integers(min_value=1, max_value=12),
)
def test_shards_read_back_every_record(tmp_path_factory, sizes, per_task):
    recs = [os.urandom(n) for n in sizes]
    path = str(tmp_path_factory.mktemp("h") / "r.rec")
    write_records(path, recs)
    shards = make_shards([(path, count_records(path))], per_task)
    assert [r for s in shards for r in read_records(s.path, s.start, s.end)] == recs
