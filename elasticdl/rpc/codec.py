"""numpy arrays <-> ``Tensor`` messages: raw little-endian bytes, dtype and shape.

The gRPC edges call this; nothing below them sees protobuf.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from elasticdl.config.sections import WIRE_DTYPES
from elasticdl.errors import JobFailure
from elasticdl.model.aligned_arrays import aligned_empty
from elasticdl.proto import elasticdl_pb2

_ALLOWED_DTYPES = {"float32", "float64", "float16", "bfloat16", "int32", "int64", "bool"}
# WIRE_DTYPES: what dense float32 tensors may travel as (--wire_dtype): float32 itself, or half
# the bytes. A received bfloat16 tensor is widened to float32 at once (numpy has no bfloat16 of
# its own); float16 stays float16 until the receiver widens it (``widened``).

# Streamed messages carry about this many tensor bytes: Python gRPC moves 1 MB messages
# several times faster than one message of tens of MB (docs/benchmarks.md).
CHUNK_BYTES = 1 << 20


class TensorDecodeError(JobFailure, ValueError):
    """A Tensor message whose dtype, shape and byte count do not agree."""


def wire_dtype_problem(wire_dtype: str) -> str:
    """Why ``wire_dtype`` is not one a tensor may travel as ('' when it is; '' is float32)."""
    if wire_dtype in ("", *WIRE_DTYPES):
        return ""
    return f"wire_dtype {wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)} (empty: float32)"


def widened(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` with every float16 one as float32 (the others as they are, no copy): what a
    float16 wire hands back (bfloat16 ones were widened as they were decoded)."""
    return {name: value.astype(np.float32) if value.dtype == np.float16 else value
            for name, value in arrays.items()}


def encode(name: str, array: np.ndarray) -> elasticdl_pb2.Tensor:
    array = wire_array(array)
    return elasticdl_pb2.Tensor(name=name, dtype=array.dtype.name, shape=array.shape, content=array.tobytes())


def decode(tensor: elasticdl_pb2.Tensor, writable: bool = False) -> np.ndarray:
    """The array (read-only unless ``writable``: that costs a copy); raises TensorDecodeError."""
    dtype, shape, expected = tensor_meta(tensor)
    if tensor.offset or expected != len(tensor.content):
        raise TensorDecodeError(
            f"tensor {tensor.name!r}: shape {shape} of {tensor.dtype} needs {expected} bytes, "
            f"message carries {len(tensor.content)}" + (f" from byte {tensor.offset}" if tensor.offset else "")
        )
    if writable and dtype.name != "bfloat16":  # (widening bfloat16 makes a writable copy anyway)
        return _view(tensor, dtype, shape, bytearray(tensor.content))
    return _widen_bfloat16(_view(tensor, dtype, shape))


def _view(tensor, dtype: np.dtype, shape: tuple[int, ...], buffer=None) -> np.ndarray:
    """The tensor's bytes (or ``buffer``) as an array of ``dtype`` and ``shape``, not copied."""
    try:
        return np.frombuffer(tensor.content if buffer is None else buffer, dtype=dtype).reshape(shape)
    except ValueError as err:  # an empty shape numpy cannot hold, e.g. (0, 2**62, 2**62)
        raise TensorDecodeError(f"tensor {tensor.name!r}: shape {shape}: {err}") from None


def _bfloat16() -> np.dtype:
    """numpy's bfloat16 (ml_dtypes, a dependency of TensorFlow): imported on first use, since
    its import takes a tenth of a second that a float32 job should not pay at start-up."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _widen_bfloat16(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def tensor_meta(tensor: elasticdl_pb2.Tensor) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, byte count) of the whole tensor a message (or a piece of it) names."""
    if tensor.dtype not in _ALLOWED_DTYPES:
        raise TensorDecodeError(
            f"tensor {tensor.name!r}: unsupported dtype {tensor.dtype!r} "
            f"(allowed: {', '.join(sorted(_ALLOWED_DTYPES))})"
        )
    dtype = _bfloat16() if tensor.dtype == "bfloat16" else np.dtype(tensor.dtype).newbyteorder("<")
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"tensor {tensor.name!r}: negative dimension in shape {shape}")
    # Python ints: numpy's int64 product wraps around for a forged shape like (2**40, 2**40).
    return dtype, shape, math.prod(shape) * dtype.itemsize


def encode_dict(arrays: dict[str, np.ndarray]) -> list[elasticdl_pb2.Tensor]:
    return [encode(name, value) for name, value in arrays.items()]


def decode_list(tensors, writable: bool = False) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in out:
            raise TensorDecodeError(f"tensor {tensor.name!r} appears twice in one message")
        out[tensor.name] = decode(tensor, writable)
    return out


def serialize_with_tensors(
    head, field_number: int, arrays: dict[str, np.ndarray], wire_dtype: str = "float32"
) -> bytes:
    """``head`` serialized, with ``arrays`` appended as its repeated ``Tensor`` field ``field_number``.

    The message is the one filling the field would give (protobuf concatenates repeated
    fields), but each array's bytes are copied once, into the result, instead of
    three times (tobytes, into the message, out of it): the PS data plane is mostly copies.
    ``wire_dtype`` (WIRE_DTYPES): float32 arrays travel as that (others as they are).
    """
    parts = [head.SerializeToString()]
    for name, array in arrays.items():
        array = wire_array(array, wire_dtype)
        parts += _tensor_field(field_number, name, array.dtype, array.shape, 0, array.reshape(-1).view(np.uint8).data)
    return b"".join(parts)


def serialize_chunks(
    head, field_number: int, arrays: dict[str, np.ndarray], later_head=None, chunk_bytes: int = CHUNK_BYTES,
    wire_dtype: str = "float32",
) -> list[bytes]:
    """Like ``serialize_with_tensors``, cut into messages of about ``chunk_bytes`` for a stream.

    Small tensors share a message; a large one is cut into pieces (``Tensor.offset``) that
    ``TensorAssembler`` joins again. The first message starts with ``head``, the others with
    ``later_head`` (default: ``head``). Each byte is copied once, as in serialize_with_tensors.
    """
    return list(iter_chunks(head, field_number, arrays, later_head, chunk_bytes, wire_dtype))


def iter_chunks(
    head, field_number: int, arrays: dict[str, np.ndarray], later_head=None, chunk_bytes: int = CHUNK_BYTES,
    wire_dtype: str = "float32",
) -> Iterator[bytes]:
    """``serialize_chunks`` one message at a time: a stream can send the first while the
    next is being written (the arrays must not change until the last is out)."""
    heads = [head.SerializeToString(), (later_head or head).SerializeToString()]
    parts, filled = [heads[0]], 0
    for name, array in arrays.items():
        array = wire_array(array)
        # Cast piece by piece (--wire_dtype): the first message leaves before the whole model is
        # cast, and each piece is cast into a small buffer that the join then reads from cache.
        cast = _cast_to(array, wire_dtype)
        itemsize = array.itemsize if cast is None else cast.itemsize
        flat, nbytes = array.reshape(-1), array.size * itemsize
        start = 0
        while True:
            if filled >= chunk_bytes:
                yield b"".join(parts)
                parts, filled = [heads[1]], 0
            stop = min(nbytes, start + chunk_bytes - filled)
            if stop < nbytes:  # pieces hold whole elements (a bfloat16 piece is widened on its own)
                stop = max(stop - stop % itemsize, start + itemsize)
            if cast is None:
                content = flat.view(np.uint8).data[start:stop]
            else:
                with np.errstate(over="ignore"):  # beyond float16's range: inf, which a PS refuses as such
                    content = flat[start // itemsize:stop // itemsize].astype(cast).view(np.uint8).data
            dtype = array.dtype if cast is None else cast
            parts += _tensor_field(field_number, name, dtype, array.shape, start, content)
            filled += stop - start + _PIECE_OVERHEAD
            start = stop
            if start >= nbytes:
                break
    yield b"".join(parts)


@dataclass(frozen=True)
class TensorPiece:
    """A ``Tensor`` read straight from a message's bytes: ``content`` is a view, not a copy."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    content: memoryview
    offset: int = 0


def parse_with_tensors(data: bytes, message_class, field_number: int) -> tuple[object, list[TensorPiece]]:
    """(head, tensors) of a serialized ``message_class`` whose repeated ``Tensor`` field
    ``field_number`` is read without protobuf: the contents stay views of ``data``.

    What ``parse`` would give, minus two copies of every tensor's bytes (protobuf copies
    the message, then each ``content`` it is asked for): the streamed data plane's
    receiving side is mostly such copies. The other fields go through protobuf. Raises
    TensorDecodeError for bytes that are not such a message.
    """
    view = memoryview(data)
    head_parts: list[memoryview] = []
    tensors: list[TensorPiece] = []
    pos, end = 0, len(view)
    try:
        while pos < end:
            start = pos
            key, pos = _read_varint(view, pos)
            field, wire = key >> 3, key & 7
            if field == field_number and wire == 2:
                size, pos = _read_varint(view, pos)
                tensors.append(_parse_tensor(view, pos, pos + size))
                pos += size
            else:
                pos = _skip_field(view, pos, wire)
                head_parts.append(view[start:pos])
        if pos != end:
            raise TensorDecodeError("the message ends inside a field")
        head = message_class.FromString(b"".join(head_parts))
    except TensorDecodeError:
        raise
    except (IndexError, ValueError, DecodeError) as err:  # truncated varints, a head protobuf refuses
        raise TensorDecodeError(f"not a {message_class.DESCRIPTOR.name} message: {err}") from None
    return head, tensors


def _parse_tensor(view: memoryview, pos: int, end: int) -> TensorPiece:
    if end > len(view):
        raise TensorDecodeError("a tensor runs past the end of its message")
    name = dtype = ""
    shape: list[int] = []
    content = view[0:0]
    offset = 0
    while pos < end:
        key, pos = _read_varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            size, pos = _read_varint(view, pos)
            value = view[pos:pos + size]
            pos += size
            if field == 1:
                name = str(value, "utf-8")
            elif field == 2:
                dtype = str(value, "utf-8")
            elif field == 3:  # packed shape
                inner = 0
                while inner < size:
                    dim, inner = _read_varint(value, inner)
                    shape.append(_signed(dim))
            elif field == 4:
                content = value
        elif wire == 0 and field in (3, 5):
            number, pos = _read_varint(view, pos)
            if field == 3:
                shape.append(_signed(number))
            else:
                offset = _signed(number)
        else:
            pos = _skip_field(view, pos, wire)
    if pos != end:
        raise TensorDecodeError("a tensor's last field runs past its end")
    return TensorPiece(name, dtype, tuple(shape), content, offset)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise TensorDecodeError("a varint longer than 10 bytes")


def _skip_field(view: memoryview, pos: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(view, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        size, pos = _read_varint(view, pos)
        if pos + size > len(view):
            raise TensorDecodeError("a field runs past the end of its message")
        return pos + size
    if wire == 5:
        return pos + 4
    raise TensorDecodeError(f"unsupported wire type {wire}")


def _signed(number: int) -> int:
    """int64 fields are two's complement varints."""
    return number - (1 << 64) if number >= 1 << 63 else number


class TensorAssembler:
    """Tensors streamed in pieces (``serialize_chunks``) put back together, each piece checked.

    A tensor that arrives whole is used as it is (read-only, no copy); pieces are copied
    into one array, in order. ``result()`` raises TensorDecodeError if a tensor is incomplete.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}  # float32 for a bfloat16 tensor: widened piece by piece
        self._received: dict[str, int] = {}  # bytes on the wire
        self._meta: dict[str, tuple[str, tuple[int, ...], int]] = {}  # wire dtype, shape, wire bytes

    def add(self, tensors) -> None:
        for tensor in tensors:
            self._add(tensor)

    def _add(self, tensor: elasticdl_pb2.Tensor) -> None:
        name = tensor.name
        array = self._arrays.get(name)
        if array is None:
            if tensor.offset:
                raise TensorDecodeError(
                    f"tensor {name!r}: its first piece starts at byte {tensor.offset}, not 0"
                )
            dtype, shape, expected = tensor_meta(tensor)
            self._meta[name] = (tensor.dtype, shape, expected)
            if len(tensor.content) == expected:  # whole: no copy (but bfloat16's widening)
                self._arrays[name] = _widen_bfloat16(_view(tensor, dtype, shape))
                self._received[name] = expected
                return
            try:
                # Aligned: the worker's variables can take it without a copy (model/variable_assign.py).
                self._arrays[name] = array = aligned_empty(shape, np.float32 if dtype.name == "bfloat16" else dtype)
            except (MemoryError, ValueError) as err:  # a shape no message could fill
                raise TensorDecodeError(f"tensor {name!r}: shape {shape} of {tensor.dtype}: {err}") from None
            self._received[name] = 0
        received = self._received[name]
        dtype_name, shape, total = self._meta[name]
        if (tensor.dtype, tuple(tensor.shape)) != (dtype_name, shape):
            raise TensorDecodeError(
                f"tensor {name!r}: a piece says {tensor.dtype} {tuple(tensor.shape)}, "
                f"the first said {dtype_name} {shape}"
            )
        if received == total:
            raise TensorDecodeError(f"tensor {name!r} appears twice in one message")
        stop = tensor.offset + len(tensor.content)
        if tensor.offset != received or stop > total:
            raise TensorDecodeError(
                f"tensor {name!r}: a piece covers bytes {tensor.offset}-{stop} of {total}, "
                f"the next piece should start at {received}"
            )
        if dtype_name == "bfloat16":  # widened as it is copied: one pass over the bytes
            if stop % 2:
                raise TensorDecodeError(f"tensor {name!r}: a bfloat16 piece ends inside an element (byte {stop})")
            array.reshape(-1)[received // 2:stop // 2] = np.frombuffer(tensor.content, _bfloat16())
        else:
            array.reshape(-1).view(np.uint8)[received:stop] = np.frombuffer(tensor.content, np.uint8)
        self._received[name] = stop

    def result(self) -> dict[str, np.ndarray]:
        for name, (_, _, total) in self._meta.items():
            if self._received[name] != total:
                raise TensorDecodeError(f"tensor {name!r}: {self._received[name]} of its {total} bytes arrived")
        return self._arrays


def wire_array(array, wire_dtype: str = "float32") -> np.ndarray:
    """``array`` little-endian and C-contiguous, as its bytes travel; a float32 one cast to
    ``wire_dtype`` (rounded to nearest even)."""
    array = np.asarray(array)
    cast = _cast_to(array, wire_dtype)
    if cast is not None:
        with np.errstate(over="ignore"):  # beyond float16's range: inf, which a PS refuses as such
            return array.astype(cast, order="C")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray would make a scalar 1-d)
    return array


def _cast_to(array: np.ndarray, wire_dtype: str) -> np.dtype | None:
    """The dtype ``array`` travels as, if it is cast (a float32 array, a reduced ``wire_dtype``)."""
    if wire_dtype in ("", "float32") or array.dtype != np.float32:
        return None
    return _bfloat16() if wire_dtype == "bfloat16" else np.dtype(wire_dtype)


def _tensor_field(field_number: int, name: str, dtype: np.dtype, shape: tuple, start: int, content) -> list:
    """The wire parts of one ``Tensor`` in field ``field_number``: ``content``, the bytes of a
    ``dtype`` tensor of ``shape`` from byte ``start`` on."""
    meta = elasticdl_pb2.Tensor(name=name, dtype=dtype.name, shape=shape, offset=start).SerializeToString()
    content_key = _key(_TENSOR_CONTENT_FIELD) + _varint(len(content))
    return [_key(field_number) + _varint(len(meta) + len(content_key) + len(content)), meta, content_key, content]


# Bytes a piece adds besides its content (name, dtype, shape): counted against a message's size.
_PIECE_OVERHEAD = 64
_TENSOR_CONTENT_FIELD = elasticdl_pb2.Tensor.DESCRIPTOR.fields_by_name["content"].number


def _key(field_number: int) -> bytes:
    return _varint(field_number << 3 | 2)  # wire type 2: length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
