"""Parquet files through pyarrow: count rows from the footer, read a row range as Example records or columns.

Counting reads only the footer (its row-group metadata: one ranged read of the file's tail
on an object store), never the data; a process keeps the footers it read, and a worker
also those the master hands it (``remember_footer``). Reading a row range reads only the
row groups it overlaps and only the projected ``columns``: from a remote file, a row
group's column chunks in one ranged request (``fs.read_range``; on S3 over a presigned
URL) decoded from memory; from a local one through pyarrow's pre-buffered reads. Each row
becomes a serialized tf.train.Example (elasticdl/data/examples.py), so ``dataset_fn``
parses Parquet rows as it parses TFRecord records; or, with ``--data_reader_params
records=columns``, the range comes as numpy columns (elasticdl/data/columns.py), and a
worker streams them: a row group at a time, the next one read in a thread
(elasticdl/data/read_ahead.py) while the rows before it train.

A task is best a whole number of row groups (``--records_per_task``): a row group that two
tasks share is read by both.
"""

from __future__ import annotations

import io
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from elasticdl import fs
from elasticdl.data import columns as _columns
from elasticdl.data import examples
from elasticdl.data.columns import Columns, ColumnStream
from elasticdl.data.errors import CorruptRecordError, DataError
from elasticdl.data.read_ahead import read_ahead

logger = logging.getLogger(__name__)

_FOOTERS_KEPT = 256
# path -> (size, FileMetaData): a worker reads a file task after task. A local file's size is
# checked on every open (a rewritten file has another size); an object's is learned once,
# since a HEAD request per task costs as much as reading a row group from a nearby store, and
# a job's data does not change while it runs (a changed file: restart the job, see below).
_footers: OrderedDict[str, tuple[int, object]] = OrderedDict()
_footers_lock = threading.Lock()


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("Parquet data needs pyarrow: pip install 'elasticdl[parquet]'") from None
    return pq


def _known(path: str) -> tuple[int, object] | None:
    with _footers_lock:
        return _footers.get(path)


def _open(path: str):
    return fs.open(path, "rb")


def _file(path: str, source, size: int):
    """A ParquetFile over ``source`` (the file, ``size`` bytes), its footer kept (see _footers)."""
    pq = _pq()
    known = _known(path)
    metadata = known[1] if known is not None and known[0] == size else None
    try:
        parquet = pq.ParquetFile(source, metadata=metadata, pre_buffer=True)
    except (OSError, ValueError) as err:
        if isinstance(err, fs.StorageError):
            raise
        better = fs.explain(path, err)
        if better is not None:
            raise better from err
        raise CorruptRecordError(path, 0, 0, f"not a readable Parquet file ({err})") from err
    _keep(path, size, parquet.metadata)
    return parquet


def _keep(path: str, size: int, metadata) -> None:
    with _footers_lock:
        _footers[path] = (size, metadata)
        _footers.move_to_end(path)
        while len(_footers) > _FOOTERS_KEPT:
            _footers.popitem(last=False)


# A remote file's footer comes in one request for its last this many bytes (a suffix range, so
# no request for the file's size first); a footer that is bigger costs one request more.
_TAIL_BYTES = 64 << 10


def _metadata(path: str) -> tuple[int, object]:
    """(size, FileMetaData) of the file: the footer kept, or read (and then kept)."""
    known = _known(path)
    if fs.is_remote(path):
        if known is not None:
            return known
        size, tail = fs.read_tail(path, _TAIL_BYTES)
        return size, _file(path, _Fetched(path, size, [(size - len(tail), tail)]), size).metadata
    size = fs.size(path)
    if known is not None and known[0] == size:
        return known
    with _open(path) as handle:
        return size, _file(path, handle, size).metadata


def kept_footer(path: str) -> tuple[int, bytes] | None:
    """(size, the footer as a footer-only Parquet file) of a file whose footer this process
    read and keeps, for another process to ``remember_footer``; None when it keeps none."""
    known = _known(path)
    if known is None:
        return None
    out = io.BytesIO()
    known[1].write_metadata_file(out)
    return known[0], out.getvalue()


def remember_footer(path: str, size: int, footer: bytes) -> None:
    """Keep the footer another process read (``kept_footer``): reading the file needs no request
    for it. A footer that does not parse is ignored: the file's own is read when needed."""
    if _known(path) is not None:
        return
    try:
        metadata = _pq().read_metadata(_pa_buffer(footer))
    except (OSError, ValueError) as err:
        logger.warning("%s: the footer handed over does not parse (%s); reading the file's own", path, err)
        return
    _keep(path, size, metadata)


def _pa_buffer(data: bytes):
    import pyarrow as pa

    return pa.BufferReader(data)


def count_records(path: str) -> int:
    """The number of rows, from the footer alone."""
    return _metadata(path)[1].num_rows


def schema(path: str):
    """The file's Arrow schema, struct columns flattened (``parent.child``), from the footer."""
    arrow = _metadata(path)[1].schema.to_arrow_schema()
    return examples.flatten_structs(arrow.empty_table()).schema


def read_records(path: str, start: int, end: int, columns: Sequence[str] | None = None) -> Iterator[bytes]:
    """Yield rows ``start`` .. ``end - 1`` as serialized tf.train.Example (only ``columns``, when given)."""
    _check_range(path, start, end)
    return _iter_rows(path, start, end, list(columns) if columns else None)


def read_columns(path: str, start: int, end: int, columns: Sequence[str] | None = None) -> Columns:
    """Rows ``start`` .. ``end - 1`` as Columns (elasticdl/data/columns.py; only ``columns``, when given).

    All of it, before it returns; ``stream_columns`` hands out the rows as they arrive.
    """
    _check_range(path, start, end)
    names = list(columns) if columns else None
    if start == end:
        return _columns.from_arrow(_table_schema(path, names).empty_table())
    pieces = [_columns.from_arrow(t) for t in _row_group_tables(path, start, end, names)]
    return pieces[0] if len(pieces) == 1 else _columns.concat(pieces)


def stream_columns(path: str, start: int, end: int, columns: Sequence[str] | None = None) -> Columns | ColumnStream:
    """As ``read_columns``, but a range of several row groups comes as a ColumnStream: its first
    row group at once, each next one read in a thread while the rows before it train."""
    _check_range(path, start, end)
    groups, _ = _groups(path, _metadata(path)[1], start, end)
    if len(groups) < 2:
        return read_columns(path, start, end, columns)
    names = list(columns) if columns else None
    pieces = read_ahead(_columns.from_arrow(table) for table in _row_group_tables(path, start, end, names))
    return ColumnStream(pieces, end - start)


def _row_group_tables(path: str, start: int, end: int, columns: list[str] | None) -> Iterator[object]:
    """Rows [start, end), a row group at a time, as Arrow tables (the first and last cut to the range).

    A local file is read through pyarrow; a remote one a row group at a time, its column chunks
    fetched in one ranged request (fs.read_range) and decoded from memory.
    """
    if not fs.is_remote(path):
        with _open(path) as handle:  # open while the tables are taken: closed by their end or close()
            parquet = _file(path, handle, fs.size(path))
            groups, first_row = _groups(path, parquet.metadata, start, end)
            yield from _cut(path, groups, first_row, start, end,
                            lambda index: parquet.read_row_group(index, columns=columns))
        return
    size, metadata = _metadata(path)
    groups, first_row = _groups(path, metadata, start, end)
    yield from _cut(path, groups, first_row, start, end,
                    lambda index: _read_remote_group(path, size, metadata, index, columns))


def _check_range(path: str, start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"{path}: invalid record range [{start}, {end})")


def _table_schema(path: str, columns: list[str] | None):
    import pyarrow as pa

    arrow = _metadata(path)[1].schema.to_arrow_schema()
    return arrow if columns is None else pa.schema([arrow.field(c) for c in columns])


def _iter_rows(path: str, start: int, end: int, columns: list[str] | None) -> Iterator[bytes]:
    if start == end:
        return
    for table in _row_group_tables(path, start, end, columns):
        yield from examples.encode(table)


def _cut(path: str, groups: list[int], row: int, start: int, end: int, read) -> Iterator[object]:
    """``read(index)`` of each row group, cut to rows [start, end); a damaged object is named."""
    for index in groups:
        try:
            table = read(index)
        except (OSError, ValueError) as err:  # a truncated or damaged object
            if isinstance(err, fs.StorageError):
                raise
            raise _unreadable(path, start, end, err) from err
        lo, hi = max(start, row), min(end, row + table.num_rows)
        yield table.slice(lo - row, hi - lo)
        row += table.num_rows


# Column chunks closer than this are fetched in one request: a request costs more than reading
# this many bytes more from a nearby store.
_HOLE_BYTES = 1 << 20


def _read_remote_group(path: str, size: int, metadata, index: int, columns: list[str] | None):
    """Row group ``index`` of a remote file: the column chunks ``columns`` need in one ranged
    request (a few, for far-apart columns), decoded from memory."""
    spans = _chunk_spans(metadata.row_group(index), columns)
    fetched = _Fetched(path, size, [(lo, fs.read_range(path, lo, hi)) for lo, hi in spans])
    # One thread per row group: a worker reads the next task's row groups while it converts and
    # trains this one's, and pyarrow's pool would only add its own threads' overhead to that.
    return _pq().ParquetFile(fetched, metadata=metadata).read_row_group(index, columns=columns, use_threads=False)


def _chunk_spans(group, columns: list[str] | None) -> list[tuple[int, int]]:
    """Byte ranges of the row group's column chunks that ``columns`` need, merged across small holes."""
    wanted = []
    for i in range(group.num_columns):
        chunk = group.column(i)
        name = chunk.path_in_schema
        if columns is not None and not any(name == c or name.startswith(c + ".") for c in columns):
            continue
        begin = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < begin:
            begin = chunk.dictionary_page_offset
        wanted.append((begin, begin + chunk.total_compressed_size))
    spans: list[list[int]] = []
    for lo, hi in sorted(wanted):
        if spans and lo - spans[-1][1] <= _HOLE_BYTES:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(lo, hi) for lo, hi in spans]


class _Fetched(io.RawIOBase):
    """A remote file of which some ranges are in memory, for pyarrow to decode a row group from.

    A read outside them (a writer whose chunk sizes leave out a few bytes, a column the
    projection did not name) is fetched then: it costs a request, never a wrong byte.
    """

    def __init__(self, path: str, size: int, pieces: list[tuple[int, bytes]]):
        self._path = path
        self._size = size
        self._pieces = pieces
        self._position = 0
        self.misses = 0  # reads that were fetched

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, size: int = -1):
        """The bytes from here: a view of the fetched ones (pyarrow takes any buffer), no copy."""
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        for lo, data in self._pieces:
            if lo <= start and end <= lo + len(data):
                self._position = end
                return memoryview(data)[start - lo:end - lo]
        self.misses += 1
        data = fs.read_range(self._path, start, end)
        self._position = start + len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _groups(path: str, metadata, start: int, end: int) -> tuple[list[int], int]:
    """(the row groups holding rows [start, end), the first row of the first)."""
    if end > metadata.num_rows:
        raise DataError(
            f"{path}: requested records [{start}, {end}) but the file has only {metadata.num_rows} rows. If "
            "the file changed after the job started, restart the job so its tasks are recomputed."
        )
    groups, first_row, row = [], 0, 0
    for index in range(metadata.num_row_groups):
        rows = metadata.row_group(index).num_rows
        if row + rows > start and row < end:
            if not groups:
                first_row = row
            groups.append(index)
        row += rows
    return groups, first_row


def _unreadable(path: str, start: int, end: int, err: Exception) -> Exception:
    better = fs.explain(path, err)
    if better is not None:
        return better
    return CorruptRecordError(path, start, 0, f"rows [{start}, {end}) cannot be read ({err})")


def check_schemas(paths: Sequence[str], columns: Sequence[str] | None) -> None:
    """DataError naming the file and column when the files disagree, a projected column is
    missing, or a column's type cannot become an Example feature. Reads footers only."""
    import pyarrow as pa

    first = None
    for path in paths:
        found = schema(path)
        if columns:
            missing = [c for c in columns if c not in found.names]
            if missing:
                raise DataError(
                    f"{path}: no column {', '.join(repr(c) for c in missing)} (from --data_reader_params "
                    f"columns=...); the file has {', '.join(found.names)}"
                )
            found = pa.schema([found.field(c) for c in columns])
        if first is None:
            first = (path, found)
            for field in found:
                _check_type(path, field)
            continue
        reference_path, reference = first
        for field in reference:
            if field.name not in found.names:
                raise DataError(
                    f"schema mismatch: {path} has no column {field.name!r}, which {reference_path} has. All "
                    "Parquet files of a data set need the same columns (or project the shared ones with "
                    "--data_reader_params columns=...)."
                )
            other = found.field(field.name)
            if not other.type.equals(field.type):
                raise DataError(
                    f"schema mismatch: column {field.name!r} is {other.type} in {path} but {field.type} in "
                    f"{reference_path}. Rewrite the files with one type for the column."
                )


def _check_type(path: str, field) -> None:
    import pyarrow as pa

    try:
        examples.encode(pa.table({field.name: pa.array([None], field.type)}))
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
