"""Line-oriented records (CSV and plain text): count and read a line range.

A record is one line as bytes, without its line ending. A final newline does
not start an extra empty record; a last line without a newline is a record.
With ``has_header`` the first line is skipped and not counted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from elasticdl import fs
from elasticdl.data.errors import DataError

PathLike = str | os.PathLike[str]
_CHUNK = 1 << 20


def count_records(path: PathLike, has_header: bool = False) -> int:
    """Count the lines (records) in a text file, excluding a header line."""
    lines = 0
    last = b"\n"
    # Counting newlines in large chunks is much faster than iterating lines.
    with fs.open(os.fspath(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    if last != b"\n":
        lines += 1  # last line has no trailing newline
    if has_header:
        lines = max(lines - 1, 0)
    return lines


def read_records(
    path: PathLike, start: int, end: int, has_header: bool = False
) -> Iterator[bytes]:
    """Yield lines ``start`` .. ``end - 1`` (header excluded) as bytes.

    Raises DataError (lazily, once the file is exhausted) if ``end`` is past
    the last record.
    """
    name = os.fspath(path)
    if start < 0 or end < start:
        raise ValueError(f"{name}: invalid record range [{start}, {end})")
    return _iter_lines(name, start, end, has_header)


def _iter_lines(name: str, start: int, end: int, has_header: bool) -> Iterator[bytes]:
    if start == end:
        return
    skip = start + (1 if has_header else 0)
    index = 0
    with fs.open(name, "rb") as f:
        for line in f:
            if skip:
                skip -= 1
                continue
            if line.endswith(b"\n"):
                # Also drop "\r" so files written on Windows parse the same.
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            yield line
            index += 1
            if start + index == end:
                return
    count = max(start + index - skip, 0)  # lines seen minus header
    raise DataError(
        f"{name}: requested records [{start}, {end}) but the file has only "
        f"{count} records{' after its header' if has_header else ''}. If the "
        "file changed after the job started, restart the job so its tasks "
        "are recomputed."
    )
