"""Ranged reads (fs.read_range): S3 over presigned URLs, fallen back to s3fs when they cannot
serve; a remote Parquet row group fetched in one range and decoded from memory.

The S3 endpoint is moto's server on loopback (tests/s3_fixture.py); the refusals a real store
gives and moto does not (a 403 for a refused signature) come from a plain HTTP server here.
"""

from __future__ import annotations

import http.server
import io
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticdl import fs
from elasticdl.data import CorruptRecordError, parquet
from elasticdl.data.sources import count_records, read_columns
from elasticdl.fs import presigned
from elasticdl.fs.presigned import PresignedRanges


def _table(n: int) -> pa.Table:
    rng = np.random.default_rng(3)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, n))]).astype(np.int32)
    return pa.table({
        "user": pa.array(rng.integers(0, 10**12, n)),
        "tags": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1000, int(offsets[-1])))),
        "city": pa.array([f"city-{i % 7}" for i in range(n)]),
        "label": pa.array(rng.integers(0, 2, n)),
    })


def _parquet_bytes(table: pa.Table, row_group_rows: int) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=row_group_rows)
    return out.getvalue()


def test_s3_ranges_come_over_presigned_urls(s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    data = bytes(range(256)) * 64
    s3_env.filesystem().pipe_file(f"{bucket}/blob", data)
    path = f"s3://{bucket}/blob"
    assert fs.read_range(path, 10, 5000) == data[10:5000]
    assert fs.read_range(path, 0, len(data)) == data
    # s3fs unable to serve a range: the presigned URL serves them all.
    client = fs.filesystem(path)
    assert client is fs.filesystem(path)  # fsspec keeps one instance per configuration
    monkeypatch.setattr(client, "cat_file", lambda *a, **k: pytest.fail("read through s3fs"))
    assert fs.read_range(path, 16000, 16384) == data[16000:16384]


def test_a_tail_and_the_size_come_in_one_request(s3_env, monkeypatch, tmp_path):
    bucket = s3_env.new_bucket()
    data = bytes(range(256)) * 8
    s3_env.filesystem().pipe_file(f"{bucket}/blob", data)
    path = f"s3://{bucket}/blob"
    client = fs.filesystem(path)
    for name in ("cat_file", "size", "info"):  # no HEAD for the size, no GetObject through s3fs
        monkeypatch.setattr(client, name, lambda *a, **k: pytest.fail("asked s3fs"))
    assert fs.read_tail(path, 100) == (len(data), data[-100:])
    assert fs.read_tail(path, 10_000) == (len(data), data)  # longer than the object: all of it
    local = tmp_path / "blob"
    local.write_bytes(data)
    assert fs.read_tail(str(local), 100) == (len(data), data[-100:])
    assert fs.read_tail(str(local), 10_000) == (len(data), data)


def test_ranges_and_tails_go_through_s3fs_when_presigned_reads_cannot_serve(s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    data = bytes(range(256)) * 8
    s3_env.filesystem().pipe_file(f"{bucket}/blob", data)
    path = f"s3://{bucket}/blob"
    monkeypatch.setattr(PresignedRanges, "_get", lambda *a: None)  # refused, say
    assert fs.read_range(path, 10, 300) == data[10:300]
    assert fs.read_tail(path, 100) == (len(data), data[-100:])
    assert fs.read_tail(path, 10_000) == (len(data), data)


def test_a_url_is_signed_once_and_again_before_it_expires(s3_env):
    bucket = s3_env.new_bucket()
    s3_env.filesystem().pipe_file(f"{bucket}/blob", b"0123456789")
    client = fs.filesystem(f"s3://{bucket}/blob")
    signed = []

    class Counting:
        def url(self, path, expires):
            signed.append((path, expires))
            return client.url(path, expires=expires)

    now = [0.0]
    ranges = PresignedRanges(Counting(), clock=lambda: now[0])
    for start in range(5):
        assert ranges.read(f"s3://{bucket}/blob", start, start + 3) == b"0123456789"[start:start + 3]
    assert signed == [(f"s3://{bucket}/blob", presigned.SIGNED_SECONDS)]
    now[0] = presigned.SIGNED_SECONDS / 2  # half its life gone: signed anew before the next request
    assert ranges.read(f"s3://{bucket}/blob", 0, 2) == b"01"
    assert len(signed) == 2


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A store that refuses every presigned request (a signature it does not take)."""

    requests: list[str] = []

    def do_GET(self):  # noqa: N802  (the handler's interface)
        _Refusing.requests.append(self.headers.get("Range"))
        body = b"<Error><Code>AccessDenied</Code></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_store():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Refusing.requests = []

    class Signer:
        def url(self, path, expires):
            return f"http://127.0.0.1:{server.server_port}/{path.partition('://')[2]}?Signature=x"

    yield Signer()
    server.shutdown()
    server.server_close()


def test_a_refused_presigned_read_goes_to_s3fs_and_the_bucket_is_not_tried_again(refusing_store, caplog):
    ranges = PresignedRanges(refusing_store)
    with caplog.at_level("INFO", logger="elasticdl.fs.presigned"):
        assert ranges.read("s3://locked/a.parquet", 0, 100) is None
        assert ranges.read("s3://locked/b.parquet", 5, 10) is None
        assert ranges.tail("s3://locked/b.parquet", 10) is None
    assert _Refusing.requests == ["bytes=0-99"]  # the second read did not ask
    assert "s3://locked: ranged reads over presigned URLs answered HTTP 403; reading through s3fs" in caplog.text
    assert "Signature" not in caplog.text


def test_behind_a_proxy_reads_go_through_s3fs(refusing_store, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.delenv("no_proxy", raising=False)
    assert PresignedRanges(refusing_store).read("s3://b/k", 0, 10) is None
    assert _Refusing.requests == []  # nothing went around the proxy


def test_a_missing_object_fails_as_s3fs_says(s3_env):
    bucket = s3_env.new_bucket()
    with pytest.raises(FileNotFoundError):
        fs.read_range(f"s3://{bucket}/no-such-key", 0, 10)


def test_a_remote_row_group_is_one_ranged_read_decoded_from_memory(s3_env, monkeypatch):
    bucket = s3_env.new_bucket()
    table = _table(300)
    s3_env.filesystem().pipe_file(f"{bucket}/t.parquet", _parquet_bytes(table, 100))
    path = f"s3://{bucket}/t.parquet"
    reads, misses = [], []
    real_read_range, real_fetched = fs.read_range, parquet._Fetched

    def counting(p, start, end):
        reads.append((start, end))
        return real_read_range(p, start, end)

    class Fetched(real_fetched):
        def __init__(self, *args):
            super().__init__(*args)
            misses.append(self)

    monkeypatch.setattr(fs, "read_range", counting)
    monkeypatch.setattr(parquet, "_Fetched", Fetched)
    assert count_records(path) == 300  # the footer (one request for the file's tail), kept for the reads
    assert reads == [] and sum(f.misses for f in misses) == 0
    columns = read_columns(path, 90, 210)  # three row groups
    assert len(reads) == 3 and sum(f.misses for f in misses) == 0
    assert columns[:].columns[0].values.tolist() == table["user"].to_pylist()[90:210]
    tags = columns.columns[1]
    assert [tags.values[tags.offsets[r]:tags.offsets[r + 1]].tolist() for r in range(120)] == \
        table["tags"].to_pylist()[90:210]
    reads.clear()
    projected = read_columns(path, 0, 100, ["label", "user"])  # two column chunks, one range apart
    assert projected.names == ("label", "user") and projected.columns[0].values.tolist() == \
        table["label"].to_pylist()[:100]
    assert len(reads) == 1 and reads[0][1] - reads[0][0] < len(_parquet_bytes(table, 100)) // 3 + 4096


def test_reads_outside_the_fetched_ranges_are_fetched_not_invented(tmp_path):
    table = _table(200)
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=100)
    size, metadata = parquet._metadata(path)
    nothing = parquet._Fetched(path, size, [])  # pyarrow asks for what it needs; each is a miss
    got = pq.ParquetFile(nothing, metadata=metadata).read_row_group(1)
    assert got.equals(table.slice(100, 100)) and nothing.misses > 0


def test_an_object_cut_short_after_its_footer_was_read_names_the_rows(s3_env):
    bucket = s3_env.new_bucket()
    s3 = s3_env.filesystem()
    whole = _parquet_bytes(_table(300), 100)
    s3.pipe_file(f"{bucket}/t.parquet", whole)
    path = f"s3://{bucket}/t.parquet"
    assert count_records(path) == 300
    group = pq.ParquetFile(io.BytesIO(whole)).metadata.row_group(2)
    s3.pipe_file(f"{bucket}/t.parquet", whole[:group.column(0).data_page_offset + 10])  # rewritten, cut short
    with pytest.raises(CorruptRecordError, match=r"t\.parquet.*rows \[200, 300\) cannot be read"):
        read_columns(path, 200, 300)


def test_a_footer_handed_over_saves_the_request_for_it(s3_env, monkeypatch, caplog):
    from elasticdl.data.sources import file_footer, remember_file_footer

    bucket = s3_env.new_bucket()
    table = _table(300)
    s3_env.filesystem().pipe_file(f"{bucket}/t.parquet", _parquet_bytes(table, 100))
    path = f"s3://{bucket}/t.parquet"
    assert count_records(path) == 300  # the master's read: it keeps the footer
    size, footer = file_footer(path)
    assert size == len(_parquet_bytes(table, 100)) and footer.startswith(b"PAR1")
    parquet._footers.clear()  # a worker, which never read the file
    remember_file_footer(path, size, footer)
    with monkeypatch.context() as patched:
        patched.setattr(fs, "read_tail", lambda *a: pytest.fail("asked the store for the footer"))
        assert read_columns(path, 100, 200, ["user"]).columns[0].values.tolist() == \
            table["user"].to_pylist()[100:200]
    parquet._footers.clear()
    with caplog.at_level("WARNING", logger="elasticdl.data.parquet"):
        remember_file_footer(path, size, b"PAR1 not a footer")  # ignored: the file's own is read
    assert "does not parse" in caplog.text and count_records(path) == 300
    assert file_footer(f"s3://{bucket}/t.tfrecord") is None  # other formats have no footer to hand
