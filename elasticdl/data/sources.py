"""Locate data files, dispatch on their format, and cut them into task shards."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from elasticdl.data import csv_file, tfrecord
from elasticdl.data.errors import CorruptRecordError, NoDataFilesError

_TEXT_SUFFIXES = (".csv", ".txt")


def _files_in_dir(directory: str) -> list[str]:
    """Regular, non-hidden files directly inside ``directory``, sorted."""
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    paths = (os.path.join(directory, n) for n in names)
    return [p for p in paths if os.path.isfile(p)]


def _expand(part: str) -> list[str]:
    """Files named by one spec element: a file, a directory, or a glob."""
    if os.path.isfile(part):
        return [part]
    if os.path.isdir(part):
        return _files_in_dir(part)
    files: list[str] = []
    if glob.has_magic(part):
        for match in sorted(glob.glob(part)):
            if os.path.isfile(match):
                files.append(match)
            elif os.path.isdir(match):
                files.extend(_files_in_dir(match))
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
        matched = _expand(os.path.expanduser(part))
        if not matched:
            where = f" (in {spec!r})" if len(parts) > 1 else ""
            raise NoDataFilesError(
                f"no data files found for {part!r}{where}: check that the path "
                "exists and is visible to this process (e.g. the volume is "
                "mounted), that a directory holds non-hidden files, and that "
                "a glob is quoted so the shell does not expand it"
            )
        for path in matched:
            path = os.path.normpath(path)
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
    """Return "csv" for .csv/.txt files (any case), else "tfrecord"."""
    return "csv" if path.lower().endswith(_TEXT_SUFFIXES) else "tfrecord"


def count_records(path: str, has_header: bool = False) -> int:
    """Count records in ``path``; ``has_header`` applies to CSV/text only."""
    if record_format(path) == "csv":
        return csv_file.count_records(path, has_header)
    return tfrecord.count_records(path)


def read_records(
    path: str,
    start: int,
    end: int,
    has_header: bool = False,
    on_corrupt: Callable[[CorruptRecordError], None] | None = None,
) -> Iterator[bytes]:
    """Yield records ``start`` .. ``end - 1`` of ``path`` as bytes.

    A TFRecord record whose data is corrupt raises CorruptRecordError, or with ``on_corrupt``
    is passed to it and not yielded (text lines cannot be corrupt at this level).
    """
    if record_format(path) == "csv":
        return csv_file.read_records(path, start, end, has_header)
    return tfrecord.read_records(path, start, end, on_corrupt)


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
