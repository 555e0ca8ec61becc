"""RecordIO files (the format ``pyrecordio`` writes, as the original ElasticDL's data): count,
read a record range, write. Pure Python: ``pyrecordio`` itself needs a Go toolchain to install.

A file is a sequence of chunks. Each chunk is a 20-byte header, all little-endian uint32::

    magic 0x01020304 | crc32 (IEEE) of the body | compressor | body size | records in the chunk

then the body: the chunk's records, each ``uint32 length + bytes``, compressed whole with the
compressor (0 none, 1 Snappy in its framing format, 2 gzip). Counting reads the headers only
and seeks over the bodies; reading a range decompresses only the chunks that hold it.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Iterable, Iterator

import google_crc32c

from elasticdl.data.errors import CorruptRecordError, DataError

MAGIC = 0x01020304
_HEADER = struct.Struct("<5I")
_LENGTH = struct.Struct("<I")
NONE, SNAPPY, GZIP = 0, 1, 2
SUFFIXES = (".recordio", ".rio")
_STREAM_ID = b"\xff\x06\x00\x00sNaPpY"

PathLike = str | os.PathLike[str]


def is_recordio(path: str) -> bool:
    """A RecordIO file: by its suffix, else by the magic number of its first chunk."""
    if path.lower().endswith(SUFFIXES):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and _LENGTH.unpack(head)[0] == MAGIC


def _chunks(f, name: str) -> Iterator[tuple[int, int, int, int, int]]:
    """(offset, records, checksum, compressor, body size) of each chunk, from the headers."""
    size = os.fstat(f.fileno()).st_size
    offset = 0
    index = 0
    while offset < size:
        f.seek(offset)
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise CorruptRecordError(name, index, offset, f"chunk header cut short ({len(header)} bytes)")
        magic, checksum, compressor, body, records = _HEADER.unpack(header)
        if magic != MAGIC:
            raise CorruptRecordError(name, index, offset, f"no RecordIO chunk here (magic {magic:#x})")
        if offset + _HEADER.size + body > size:
            raise CorruptRecordError(name, index, offset, f"chunk of {body} bytes runs past the end of the file")
        yield offset, records, checksum, compressor, body
        offset += _HEADER.size + body
        index += records


def count_records(path: PathLike) -> int:
    """The records in a RecordIO file, from its chunk headers."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        return sum(records for _, records, _, _, _ in _chunks(f, name))


def read_records(path: PathLike, start: int, end: int) -> Iterator[bytes]:
    """Yield records ``start`` .. ``end - 1``; DataError (lazily) if ``end`` is past the last."""
    name = os.fspath(path)
    if start < 0 or end < start:
        raise ValueError(f"{name}: invalid record range [{start}, {end})")
    return _iter_records(name, start, end)


def _iter_records(name: str, start: int, end: int) -> Iterator[bytes]:
    if start == end:
        return
    first = 0  # index of the chunk's first record
    with open(name, "rb") as f:
        for offset, records, checksum, compressor, body in list(_chunks(f, name)):
            if first + records > start:
                f.seek(offset + _HEADER.size)
                data = f.read(body)
                if zlib.crc32(data) != checksum:
                    raise CorruptRecordError(name, first, offset, "chunk checksum mismatch")
                for i, record in enumerate(_records(_decompress(data, compressor, name, first, offset), records)):
                    if start <= first + i < end:
                        yield record
            first += records
            if first >= end:
                return
    raise DataError(
        f"{name}: requested records [{start}, {end}) but the file has only {first} records. If the file "
        "changed after the job started, restart the job so its tasks are recomputed."
    )


def _records(raw: bytes, count: int) -> Iterator[bytes]:
    position = 0
    for _ in range(count):
        (length,) = _LENGTH.unpack_from(raw, position)
        position += 4
        yield raw[position:position + length]
        position += length


def _decompress(data: bytes, compressor: int, name: str, index: int, offset: int) -> bytes:
    try:
        if compressor == NONE:
            return data
        if compressor == GZIP:
            return gzip.decompress(data)
        if compressor == SNAPPY:
            return _snappy_frames(data)
    except (ValueError, OSError, IndexError, EOFError) as err:
        raise CorruptRecordError(name, index, offset, f"chunk does not decompress: {err}") from None
    raise CorruptRecordError(name, index, offset, f"unknown compressor {compressor} (0 none, 1 snappy, 2 gzip)")


def _masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _snappy_frames(data: bytes) -> bytes:
    """Snappy's framing format: a stream identifier, then compressed (0x00) or uncompressed (0x01)
    chunks, each with the masked CRC-32C of its uncompressed bytes; skippable chunks ignored."""
    out = bytearray()
    position = 0
    while position < len(data):
        kind = data[position]
        length = int.from_bytes(data[position + 1:position + 4], "little")
        payload = data[position + 4:position + 4 + length]
        if len(payload) != length:
            raise ValueError("snappy frame cut short")
        position += 4 + length
        if kind in (0x00, 0x01):
            crc = int.from_bytes(payload[:4], "little")
            block = _snappy_block(payload[4:]) if kind == 0x00 else bytes(payload[4:])
            if _masked_crc32c(block) != crc:
                raise ValueError("snappy frame checksum mismatch")
            out += block
        elif kind == 0xFF or 0x80 <= kind <= 0xFE:
            continue  # the stream identifier, padding and skippable chunks
        else:
            raise ValueError(f"reserved snappy frame type {kind:#x}")
    return bytes(out)


def _snappy_block(data: bytes) -> bytes:
    """One raw Snappy block: a varint length, then literals and back-references."""
    length = shift = position = 0
    while True:
        byte = data[position]
        position += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    out = bytearray()
    while position < len(data):
        tag = data[position]
        position += 1
        kind = tag & 3
        if kind == 0:  # literal
            size = tag >> 2
            if size >= 60:
                extra = size - 59
                size = int.from_bytes(data[position:position + extra], "little")
                position += extra
            size += 1
            out += data[position:position + size]
            position += size
            continue
        if kind == 1:
            size = 4 + ((tag >> 2) & 7)
            back = ((tag >> 5) << 8) | data[position]
            position += 1
        elif kind == 2:
            size = 1 + (tag >> 2)
            back = int.from_bytes(data[position:position + 2], "little")
            position += 2
        else:
            size = 1 + (tag >> 2)
            back = int.from_bytes(data[position:position + 4], "little")
            position += 4
        if back == 0 or back > len(out):
            raise ValueError("snappy back-reference out of range")
        for _ in range(size):  # may overlap itself: byte by byte
            out.append(out[-back])
    if len(out) != length:
        raise ValueError(f"snappy block holds {len(out)} bytes, its header says {length}")
    return bytes(out)


def write_records(path: PathLike, records: Iterable[bytes], compressor: int = SNAPPY,
                  records_per_chunk: int = 1000) -> int:
    """Write ``records`` as a RecordIO file; returns the count. Snappy chunks are written as
    uncompressed frames (valid Snappy that any reader takes, for tests and small data)."""
    count = 0
    batch: list[bytes] = []
    with open(os.fspath(path), "wb") as f:
        def flush() -> None:
            if not batch:
                return
            raw = b"".join(_LENGTH.pack(len(r)) + r for r in batch)
            if compressor == SNAPPY:
                body = bytearray(_STREAM_ID)
                for i in range(0, len(raw), 65536):
                    block = raw[i:i + 65536]
                    body += bytes([0x01]) + (len(block) + 4).to_bytes(3, "little")
                    body += _masked_crc32c(block).to_bytes(4, "little") + block
                body = bytes(body)
            elif compressor == GZIP:
                body = gzip.compress(raw, mtime=0)
            else:
                body = raw
            f.write(_HEADER.pack(MAGIC, zlib.crc32(body), compressor, len(body), len(batch)))
            f.write(body)
            batch.clear()

        for record in records:
            batch.append(bytes(record))
            count += 1
            if len(batch) >= records_per_chunk:
                flush()
        flush()
    return count
