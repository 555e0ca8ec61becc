"""numpy arrays <-> ``Tensor`` messages: raw little-endian bytes, dtype and shape.

The gRPC edges call this; nothing below them sees protobuf.
"""

from __future__ import annotations

import numpy as np

from elasticdl.proto import elasticdl_pb2

_ALLOWED_DTYPES = {"float32", "float64", "float16", "int32", "int64", "bool"}


class TensorDecodeError(ValueError):
    """A Tensor message whose dtype, shape and byte count do not agree."""


def encode(name: str, array: np.ndarray) -> elasticdl_pb2.Tensor:
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return elasticdl_pb2.Tensor(
        name=name,
        dtype=array.dtype.name,
        shape=array.shape,
        content=np.ascontiguousarray(array).tobytes(),
    )


def decode(tensor: elasticdl_pb2.Tensor, writable: bool = False) -> np.ndarray:
    """The array (read-only unless ``writable``: that costs a copy); raises TensorDecodeError."""
    if tensor.dtype not in _ALLOWED_DTYPES:
        raise TensorDecodeError(
            f"tensor {tensor.name!r}: unsupported dtype {tensor.dtype!r} "
            f"(allowed: {', '.join(sorted(_ALLOWED_DTYPES))})"
        )
    dtype = np.dtype(tensor.dtype).newbyteorder("<")
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise TensorDecodeError(f"tensor {tensor.name!r}: negative dimension in shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if expected != len(tensor.content):
        raise TensorDecodeError(
            f"tensor {tensor.name!r}: shape {shape} of {tensor.dtype} needs {expected} bytes, "
            f"message carries {len(tensor.content)}"
        )
    buffer = bytearray(tensor.content) if writable else tensor.content
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def encode_dict(arrays: dict[str, np.ndarray]) -> list[elasticdl_pb2.Tensor]:
    return [encode(name, value) for name, value in arrays.items()]


def decode_list(tensors, writable: bool = False) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in out:
            raise TensorDecodeError(f"tensor {tensor.name!r} appears twice in one message")
        out[tensor.name] = decode(tensor, writable)
    return out


def serialize_with_tensors(head, field_number: int, arrays: dict[str, np.ndarray]) -> bytes:
    """``head`` serialized, with ``arrays`` appended as its repeated ``Tensor`` field ``field_number``.

    The message is the one filling the field would give (protobuf concatenates repeated
    fields), but each array's bytes are copied once, into the result, instead of
    three times (tobytes, into the message, out of it): the PS data plane is mostly copies.
    """
    parts = [head.SerializeToString()]
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if not array.flags.c_contiguous:
            array = array.copy(order="C")  # (np.ascontiguousarray would make a scalar 1-d)
        meta = elasticdl_pb2.Tensor(name=name, dtype=array.dtype.name, shape=array.shape).SerializeToString()
        content = array.reshape(-1).view(np.uint8).data
        content_key = _key(_TENSOR_CONTENT_FIELD) + _varint(array.nbytes)
        parts += [_key(field_number) + _varint(len(meta) + len(content_key) + array.nbytes), meta, content_key, content]
    return b"".join(parts)


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
