"""Locate data files, dispatch on their format, and cut them into task shards."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from elasticdl import fs
from elasticdl.data import csv_file, parquet, recordio, tfrecord
from elasticdl.data.columns import Columns, ColumnStream
from elasticdl.data.errors import CorruptRecordError, DataError, NoDataFilesError
from elasticdl.data.kafka_address import is_kafka
from elasticdl.data.kafka_client import read_partition_range

_TEXT_SUFFIXES = (".csv", ".txt")
_PARQUET_SUFFIXES = (".parquet", ".pq")


def _expand(part: str) -> list[str]:
    """Files named by one spec element: a file, a directory, or a glob (local or remote)."""
    if fs.isfile(part):
        return [part]
    if fs.isdir(part):
        return fs.files_in(part)
    files: list[str] = []
    if fs.has_magic(part):
        for match in fs.glob(part):
            if fs.isfile(match):
                files.append(match)
            elif fs.isdir(match):
                files.extend(fs.files_in(match))
    return files


def resolve_data_files(spec: str) -> list[str]:
    """Expand a data spec into a sorted-per-element, de-duplicated file list.

    ``spec`` is a file, a directory (its regular non-hidden files), a glob, or
    several of these separated by commas. Every element must match at least
    one file: a typo in one element of a list should fail loudly rather than
    silently train on less data.
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise NoDataFilesError(
            f"empty data spec {spec!r}: pass a file, directory, or glob "
            "(several may be separated by commas)"
        )
    files: list[str] = []
    seen: set[str] = set()
    for part in parts:
        matched = _expand(part if fs.is_remote(part) else os.path.expanduser(part))
        if not matched:
            fs.check_bucket(part)  # a missing bucket or no credentials, named as such
            where = f" (in {spec!r})" if len(parts) > 1 else ""
            raise NoDataFilesError(
                f"no data files found for {part!r}{where}: check that the path "
                "exists and is visible to this process (e.g. the volume is "
                "mounted), that a directory holds non-hidden files, and that "
                "a glob is quoted so the shell does not expand it"
            )
        for path in matched:
            path = path if fs.is_remote(path) else os.path.normpath(path)
            if path not in seen:
                seen.add(path)
                files.append(path)
    return files


@dataclass(frozen=True)
class Shard:
    """Records ``start`` .. ``end - 1`` of the file at ``path``."""

    path: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid shard {self.path}[{self.start}:{self.end}]")

    @property
    def records(self) -> int:
        """Number of records in the shard."""
        return self.end - self.start


def record_format(path: str) -> str:
    """"csv" for .csv/.txt files, "parquet" for .parquet/.pq (any case), "recordio" for RecordIO
    files (by suffix or by the magic number of their first chunk, elasticdl/data/recordio.py), else
    "tfrecord"."""
    lower = path.lower()
    if is_kafka(lower):
        return "tfrecord"  # a message value is a TFRecord record's bytes: a serialized tf.train.Example
    if lower.endswith(_TEXT_SUFFIXES):
        return "csv"
    if lower.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return "recordio" if recordio.is_recordio(path) else "tfrecord"


def count_records(path: str, has_header: bool = False) -> int:
    """Count records in ``path``; ``has_header`` applies to CSV/text only."""
    kind = record_format(path)
    if kind == "csv":
        return csv_file.count_records(path, has_header)
    if kind == "parquet":
        return parquet.count_records(path)
    if kind == "recordio":
        return recordio.count_records(path)
    return tfrecord.count_records(path)


def read_records(
    path: str,
    start: int,
    end: int,
    has_header: bool = False,
    on_corrupt: Callable[[CorruptRecordError], None] | None = None,
    columns: Sequence[str] | None = None,
) -> Iterator[bytes]:
    """Yield records ``start`` .. ``end - 1`` of ``path`` as bytes.

    A TFRecord record whose data is corrupt raises CorruptRecordError, or with ``on_corrupt``
    is passed to it and not yielded (text lines cannot be corrupt at this level). A Parquet
    row comes as a serialized tf.train.Example of its ``columns`` (all when None).
    """
    if is_kafka(path):  # a stream task: offsets start .. end - 1 of one partition
        return iter(read_partition_range(path, start, end))
    kind = record_format(path)
    if kind == "csv":
        return csv_file.read_records(path, start, end, has_header)
    if kind == "parquet":
        return parquet.read_records(path, start, end, columns)
    if kind == "recordio":
        return recordio.read_records(path, start, end)  # a bad chunk checksum raises: no per-record skip
    return tfrecord.read_records(path, start, end, on_corrupt)


def read_columns(path: str, start: int, end: int, columns: Sequence[str] | None = None) -> Columns:
    """Records ``start`` .. ``end - 1`` of a Parquet file as Columns (``--data_reader_params
    records=columns``); only ``columns``, when given. Other formats have no columns: DataError."""
    _parquet_only(path)
    return parquet.read_columns(path, start, end, columns)


def _parquet_only(path: str) -> None:
    kind = record_format(path)
    if kind != "parquet":
        raise DataError(
            f"{path}: --data_reader_params records=columns reads Parquet files (.parquet, .pq), and this is "
            f"{kind}: drop records=columns to read its records as bytes"
        )


def stream_columns(path: str, start: int, end: int, columns: Sequence[str] | None = None) -> Columns | ColumnStream:
    """As ``read_columns``, with the row groups after the first read ahead while the rows before
    them train (a ColumnStream, for a range of several row groups)."""
    _parquet_only(path)
    return parquet.stream_columns(path, start, end, columns)


# A footer bigger than this is not handed from the master to the workers: each reads its own.
MAX_HANDED_FOOTER_BYTES = 1 << 20


def file_footer(path: str) -> tuple[int, bytes] | None:
    """(size, footer) of a Parquet file whose footer this process read (the master, cutting the
    tasks), for a worker to ``remember_file_footer``; None for other formats, a footer not kept
    or one over MAX_HANDED_FOOTER_BYTES."""
    if record_format(path) != "parquet":
        return None
    found = parquet.kept_footer(path)
    return found if found is not None and len(found[1]) <= MAX_HANDED_FOOTER_BYTES else None


def remember_file_footer(path: str, size: int, footer: bytes) -> None:
    """A worker keeps the footer the master handed it (``file_footer``): no request for it."""
    parquet.remember_footer(path, size, footer)


def load_records(
    path: str, start: int, end: int, as_columns: bool = False, has_header: bool = False,
    columns: Sequence[str] | None = None, batch_size: int = 0,
) -> tuple[Sequence[bytes] | Columns | ColumnStream, list[CorruptRecordError]]:
    """A task's records as a worker trains on them, and the corrupt records left out.

    ``as_columns`` (``--data_reader_params records=columns``): Parquet rows as Columns, or as
    a ColumnStream for a range of several row groups; Columns come cut into their chunks of
    ``batch_size`` rows when it is given (a read ahead is then cut in the thread that read
    it). Otherwise the records as a list of bytes; a corrupt TFRecord record is left out and
    returned with the others of its kind.
    """
    if as_columns:
        records = stream_columns(path, start, end, columns)
        if batch_size and isinstance(records, Columns):
            records.chunks(batch_size)
        return records, []
    corrupt: list[CorruptRecordError] = []
    records = list(read_records(path, start, end, has_header, on_corrupt=corrupt.append, columns=columns))
    return records, corrupt


def check_parquet_schemas(paths: Sequence[str], columns: Sequence[str] | None = None) -> None:
    """Submit time: the Parquet files among ``paths`` agree on their (projected) columns; a
    DataError names the file and the column otherwise. Reads footers only."""
    found = [p for p in paths if record_format(p) == "parquet"]
    if found:
        parquet.check_schemas(found, columns)


def make_shards(
    files_with_counts: Sequence[tuple[str, int]], records_per_task: int
) -> list[Shard]:
    """Cut each file into consecutive shards of at most ``records_per_task``."""
    if records_per_task < 1:
        raise ValueError(f"records_per_task must be at least 1, got {records_per_task}")
    shards: list[Shard] = []
    for path, count in files_with_counts:
        if count < 0:
            raise ValueError(f"{path}: negative record count {count}")
        for start in range(0, count, records_per_task):
            shards.append(Shard(path, start, min(start + records_per_task, count)))
    return shards
