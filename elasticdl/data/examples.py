"""Columns (Arrow) to serialized ``tf.train.Example`` records, a whole batch at a time, in numpy.

A Parquet row reaches ``dataset_fn`` as the bytes of a tf.train.Example holding one feature
per column, so the same ``tf.io.parse_single_example`` reads TFRecord and Parquet data.
Building Example messages one by one in Python would cost far more than reading the
columns (tens of microseconds a row); here the protobuf wire format is written for all rows
of a batch at once: the lengths of every nested message are computed bottom-up from the
payload lengths, and the bytes of every row are scattered into one buffer in a single pass.

    Example  { Features features = 1 }           Features { map<string, Feature> feature = 1 }
    Feature  { BytesList 1 | FloatList 2 | Int64List 3 }   FloatList/Int64List: packed values

Integer, boolean, date and time columns become int64 lists, floating point columns float
lists, string and binary columns bytes lists; a list column (multi-hot ids), nested lists
(flattened) and struct columns (one feature per field, named ``parent.child``) work too.
A null is an empty list: ``dataset_fn`` gives it a default or rejects the record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elasticdl.data.errors import DataError

_BYTES, _FLOAT, _INT64 = 0x0A, 0x12, 0x1A  # Feature's oneof fields 1, 2, 3, length-delimited
_FIELD_1 = 0x0A  # field 1, length-delimited: Example.features, Features.feature, list values, map key
_MAP_VALUE = 0x12  # field 2 of a map entry


_ROWS_PER_PASS = 16384  # bounds the padded matrices below to a few MB


@dataclass
class _Block:
    """Per row up to ``data.shape[1]`` bytes: row r holds ``data[r][mask[r]]`` (all of it without a mask)."""

    data: np.ndarray  # uint8 [rows, width]
    mask: np.ndarray | None = None  # bool [rows, width], valid bytes first

    @property
    def lens(self) -> np.ndarray:
        if self.mask is None:
            return np.full(self.data.shape[0], self.data.shape[1], np.int64)
        return self.mask.sum(axis=1, dtype=np.int64)


def _const(rows: int, data: bytes) -> _Block:
    return _Block(np.broadcast_to(np.frombuffer(data, np.uint8), (rows, len(data))))


_THRESHOLDS = np.array([1 << (7 * k) for k in range(1, 10)], np.uint64)


def _varint_len(values: np.ndarray) -> np.ndarray:
    v = values.astype(np.uint64, copy=False)
    n = np.ones(v.size, np.int64)
    largest = v.max() if v.size else 0
    for threshold in _THRESHOLDS:  # lengths are mostly below 128: usually no pass at all
        if threshold > largest:
            break
        n += v >= threshold
    return n


def _varint(values: np.ndarray) -> _Block:
    """Each value as a protobuf varint (an int64 below 0 as its 10-byte two's complement)."""
    v = values.astype(np.uint64, copy=False)
    n = _varint_len(v)
    width = int(n.max()) if n.size else 1
    if width == 1:
        return _Block(v.astype(np.uint8).reshape(-1, 1))
    position = np.arange(width)
    groups = ((v[:, None] >> (position.astype(np.uint64) * np.uint64(7))) & np.uint64(0x7F)).astype(np.uint8)
    groups |= (position[None, :] < (n[:, None] - 1)).astype(np.uint8) << 7
    return _Block(groups, position[None, :] < n[:, None])


def _by_row(element: _Block, row_of: np.ndarray, counts: np.ndarray) -> _Block:
    """Element blocks laid side by side per row (row r: its ``counts[r]`` elements, in order)."""
    rows = counts.size
    if element.data.shape[0] == rows and (counts == 1).all():
        return element
    most = int(counts.max()) if rows else 0
    width = element.data.shape[1]
    data = np.zeros((rows, most, width), np.uint8)
    mask = np.zeros((rows, most, width), bool)
    slot = np.arange(row_of.size) - (np.cumsum(counts) - counts)[row_of]
    data[row_of, slot] = element.data
    mask[row_of, slot] = True if element.mask is None else element.mask
    return _Block(data.reshape(rows, most * width), mask.reshape(rows, most * width))


def _join(blocks: list[_Block]) -> tuple[np.ndarray, np.ndarray]:
    """(row lengths, bytes): row r is blocks[0][r] + blocks[1][r] + ..., valid bytes only."""
    rows = blocks[0].data.shape[0]
    width = sum(b.data.shape[1] for b in blocks)
    data = np.empty((rows, width), np.uint8)
    mask = None
    column = 0
    for block in blocks:
        end = column + block.data.shape[1]
        data[:, column:end] = block.data
        if block.mask is not None:
            if mask is None:
                mask = np.ones((rows, width), bool)
            mask[:, column:end] = block.mask
        column = end
    if mask is None:
        return np.full(rows, width, np.int64), data.reshape(-1)
    return mask.sum(axis=1, dtype=np.int64), data[mask]


def _column(name: str, array) -> tuple[int, _Block, bool]:
    """(Feature kind, per-row payload, packed?) of one Arrow column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = len(array)
    row_of = np.arange(rows)
    values = array
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or pa.types.is_fixed_size_list(values.type):
        row_of = row_of[pc.list_parent_indices(values).to_numpy()]
        values = values.flatten()
    kind = values.type
    if pa.types.is_dictionary(kind):
        values = values.dictionary_decode()
        kind = values.type
    if values.null_count:
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        values, row_of = values.filter(pa.array(valid)), row_of[valid]
    counts = np.bincount(row_of, minlength=rows).astype(np.int64)
    if pa.types.is_floating(kind):
        data = values.to_numpy(zero_copy_only=False).astype("<f4")
        return _FLOAT, _by_row(_Block(data.view(np.uint8).reshape(-1, 4)), row_of, counts), True
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_temporal(kind):
        if pa.types.is_temporal(kind):
            values = values.cast(pa.int32() if pa.types.is_date32(kind) else pa.int64())
        data = values.to_numpy(zero_copy_only=False).astype(np.int64)
        return _INT64, _by_row(_varint(data.view(np.uint64)), row_of, counts), True
    if pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        values = values.cast(pa.large_binary())
        offsets = np.frombuffer(values.buffers()[1], np.int64)[values.offset:values.offset + len(values) + 1]
        lens = np.diff(offsets)
        width = int(lens.max()) if lens.size else 0
        data = np.zeros((lens.size, width), np.uint8)
        mask = np.arange(width)[None, :] < lens[:, None]
        if lens.size:
            data[mask] = np.frombuffer(values.buffers()[2], np.uint8)[offsets[0]:offsets[-1]]
        header = _varint(lens)
        element = _Block(*_pad([_const(lens.size, bytes([_FIELD_1])), header, _Block(data, mask)]))
        return _BYTES, _by_row(element, row_of, counts), False
    raise DataError(
        f"column {name!r} has type {array.type}, which no tf.train.Example feature holds: use integers, "
        "floating point numbers, strings or binary, lists of them, or structs of them"
    )


def _pad(blocks: list[_Block]) -> tuple[np.ndarray, np.ndarray]:
    """The blocks joined per row into one block, valid bytes first (for grouping into rows)."""
    lens, flat = _join(blocks)
    width = int(lens.max()) if lens.size else 0
    mask = np.arange(width)[None, :] < lens[:, None]
    data = np.zeros(mask.shape, np.uint8)
    data[mask] = flat
    return data, mask


def flatten_structs(table):
    """``table`` with every struct column replaced by its fields (``parent.child``)."""
    import pyarrow as pa

    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    return table


def encode(table) -> list[bytes]:
    """One serialized tf.train.Example per row of the Arrow ``table``, one feature per column."""
    table = flatten_structs(table)
    records: list[bytes] = []
    for offset in range(0, table.num_rows, _ROWS_PER_PASS):
        records += _encode(table.slice(offset, _ROWS_PER_PASS))
    return records


def _encode(table) -> list[bytes]:
    rows = table.num_rows
    blocks: list[_Block] = []
    field_lens = np.zeros(rows, np.int64)
    for name in table.column_names:
        kind, payload, packed = _column(name, table.column(name).combine_chunks())
        key = name.encode()
        payload_len = payload.lens
        list_len = payload_len + (1 + _varint_len(payload_len) if packed else 0)
        feature_len = 1 + _varint_len(list_len) + list_len
        key_header = bytes([_FIELD_1, len(key)]) + key + bytes([_MAP_VALUE]) if len(key) < 128 else (
            bytes([_FIELD_1]) + _varint(np.array([len(key)])).data[0].tobytes() + key + bytes([_MAP_VALUE]))
        entry_len = len(key_header) + _varint_len(feature_len) + feature_len
        blocks += [_const(rows, bytes([_FIELD_1])), _varint(entry_len), _const(rows, key_header),
                   _varint(feature_len), _const(rows, bytes([kind])), _varint(list_len)]
        if packed:
            blocks += [_const(rows, bytes([_FIELD_1])), _varint(payload_len)]
        blocks.append(payload)
        field_lens += 1 + _varint_len(entry_len) + entry_len
    lens, flat = _join([_const(rows, bytes([_FIELD_1])), _varint(field_lens), *blocks])
    data = flat.tobytes()
    ends = np.cumsum(lens).tolist()
    return [data[a:b] for a, b in zip([0, *ends[:-1]], ends)]
