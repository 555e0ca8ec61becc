"""TFRecord files without TensorFlow: count, read a record range, write.

Each record is framed as::

    uint64  length            (little-endian)
    uint32  masked_crc32c(length bytes)
    bytes   data[length]
    uint32  masked_crc32c(data)

The master only counts records, so counting walks the 12-byte headers and
seeks over the bodies; it never reads record data.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

import google_crc32c

from elasticdl import fs
from elasticdl.data.errors import CorruptRecordError, DataError

_HEADER = struct.Struct("<QI")  # length, masked crc of the length bytes
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_HEADER_SIZE = _HEADER.size  # 12
_FOOTER_SIZE = _CRC.size  # 4
_MASK_DELTA = 0xA282EAD8
# Larger than io.DEFAULT_BUFFER_SIZE so that walking many small records does
# mostly in-buffer seeks instead of a read syscall every few records.
_BUFFER_SIZE = 1 << 16

PathLike = str | os.PathLike[str]


def masked_crc(data: bytes) -> int:
    """Return TFRecord's masked CRC32C of ``data``."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _read_header(
    f: BinaryIO, path: str, index: int, offset: int, size: int
) -> int | None:
    """Read and verify the header of record ``index`` at ``offset``.

    Returns the data length, or None at a clean end of file. Also checks
    that the whole record fits in the file, so callers may seek over it.
    """
    header = f.read(_HEADER_SIZE)
    if not header:
        return None
    if len(header) < _HEADER_SIZE:
        raise CorruptRecordError(
            path,
            index,
            offset,
            f"header cut short ({len(header)} of {_HEADER_SIZE} bytes)",
        )
    length, length_crc = _HEADER.unpack(header)
    if masked_crc(header[:8]) != length_crc:
        raise CorruptRecordError(path, index, offset, "length CRC mismatch")
    # Checked against the file size rather than discovered by a short read:
    # seeking past EOF succeeds silently, so counting would miss truncation.
    if offset + _HEADER_SIZE + length + _FOOTER_SIZE > size:
        raise CorruptRecordError(
            path,
            index,
            offset,
            f"record of {length} bytes runs past end of file ({size} bytes)",
        )
    return length


def _open(name: str) -> BinaryIO:
    if fs.is_remote(name):
        return fs.open(name, "rb")  # streams in large blocks with read-ahead
    return open(name, "rb", buffering=_BUFFER_SIZE)


def count_records(path: PathLike) -> int:
    """Count the records in a TFRecord file, verifying every length CRC."""
    name = os.fspath(path)
    size = fs.size(name)
    with _open(name) as f:
        index = offset = 0
        while True:
            length = _read_header(f, name, index, offset, size)
            if length is None:
                return index
            f.seek(length + _FOOTER_SIZE, os.SEEK_CUR)
            offset += _HEADER_SIZE + length + _FOOTER_SIZE
            index += 1


def read_records(
    path: PathLike, start: int, end: int, on_corrupt: Callable[[CorruptRecordError], None] | None = None
) -> Iterator[bytes]:
    """Yield records ``start`` .. ``end - 1`` of a TFRecord file.

    Both CRCs of every yielded record are verified. A record whose data fails its CRC raises
    CorruptRecordError, or, with ``on_corrupt``, is passed to it and skipped (its framing is
    intact, so the records after it are read as usual; a broken header cannot be skipped and
    always raises). Raises DataError (lazily, once the file is exhausted) if ``end`` is past
    the last record.
    """
    name = os.fspath(path)
    if start < 0 or end < start:
        raise ValueError(f"{name}: invalid record range [{start}, {end})")
    # Argument errors above are raised at call time; the generator only
    # opens the file once iteration starts.
    return _iter_records(name, start, end, on_corrupt)


def _iter_records(
    name: str, start: int, end: int, on_corrupt: Callable[[CorruptRecordError], None] | None = None
) -> Iterator[bytes]:
    if start == end:
        return
    size = fs.size(name)
    with _open(name) as f:
        index = offset = 0
        while index < end:
            length = _read_header(f, name, index, offset, size)
            if length is None:
                raise DataError(
                    f"{name}: requested records [{start}, {end}) but the file "
                    f"has only {index} records. If the file changed after the job "
                    "started, restart the job so its tasks are recomputed."
                )
            if index < start:
                f.seek(length + _FOOTER_SIZE, os.SEEK_CUR)
            else:
                data = f.read(length)
                (data_crc,) = _CRC.unpack(f.read(_FOOTER_SIZE))
                if masked_crc(data) == data_crc:
                    yield data
                elif on_corrupt is None:
                    raise CorruptRecordError(name, index, offset, "data CRC mismatch")
                else:
                    on_corrupt(CorruptRecordError(name, index, offset, "data CRC mismatch"))
            offset += _HEADER_SIZE + length + _FOOTER_SIZE
            index += 1


def write_records(path: PathLike, records: Iterable[bytes]) -> int:
    """Write ``records`` as a TFRecord file (uncompressed); return the count."""
    count = 0
    with open(os.fspath(path), "wb") as f:
        for data in records:
            data = bytes(data)
            length = _LENGTH.pack(len(data))
            f.write(length)
            f.write(_CRC.pack(masked_crc(length)))
            f.write(data)
            f.write(_CRC.pack(masked_crc(data)))
            count += 1
    return count
