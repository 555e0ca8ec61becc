"""Raw-TCP framing for bulk tensor bytes (--tensor_transport tcp), beside the gRPC control plane.

Python gRPC moves a large model in 1 MB messages, each a Python bytes object joined on one
side and copied out on the other, at 1.3-1.9 GB/s on loopback where a plain socket moves
2.2-2.6 GB/s (docs/benchmarks.md). Here a pull or a push is one frame on a socket kept open
per PS: a fixed header, the request or answer as its protobuf message with each tensor's
name, dtype and shape but no content, then every tensor's raw bytes in that order, sent
straight from the arrays (``sendall``) and received straight into arrays made for them
(``recv_into``): no Python-level copy on either side.

Every connection starts with an AUTH frame carrying the job's token, compared in constant
time; anything else first, or a wrong token, closes it. A frame with a bad magic, kind or
length closes the connection too: the stream cannot be trusted after it (a refused push whose
bytes are known is read to its end first, so that the answer reaches its worker). The PS end is
``elasticdl/ps/bulk_server.py``; the worker's, ``elasticdl/rpc/ps_client.py``.
"""

from __future__ import annotations

import socket
import struct

import numpy as np

from elasticdl.errors import JobFailure
from elasticdl.model.aligned_arrays import aligned_empty
from elasticdl.proto import elasticdl_pb2
from elasticdl.rpc import codec as tensor_codec

MAGIC = b"EDLB"
HEADER = struct.Struct("<4sBI")  # magic, kind, head length
AUTH, PULL, PUSH, REPLY, ERROR = 1, 2, 3, 4, 5
KINDS = frozenset({AUTH, PULL, PUSH, REPLY, ERROR})
# A head is a request or an answer without tensor bytes: names, shapes, a few fields.
MAX_HEAD_BYTES = 16 << 20
# Sockets hold this much in flight each way (the kernel may cap it): fewer wake-ups per MB.
SOCKET_BUFFER_BYTES = 4 << 20


class BulkProtocolError(JobFailure, ConnectionError):
    """Bytes on a bulk connection that are not a frame of this protocol (the connection is closed)."""


class PushMaybeApplied(ConnectionError):
    """A push's connection broke after its bytes were sent: the PS may have applied it."""


class BulkRefused(JobFailure, RuntimeError):
    """The PS answered a bulk request with an error: ``code`` as gRPC's status names it."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def send_frame(sock: socket.socket, kind: int, head: bytes, arrays=()) -> None:
    """One frame: header, ``head``, then each array's bytes (C-contiguous arrays, sent as they are)."""
    sock.sendall(HEADER.pack(MAGIC, kind, len(head)) + head)
    for array in arrays:
        if array.nbytes:
            sock.sendall(array.reshape(-1).view(np.uint8).data)


def recv_head(sock: socket.socket) -> tuple[int, bytes]:
    """(kind, head) of the next frame; BulkProtocolError if it is not one, ConnectionError at EOF."""
    header = bytearray(HEADER.size)
    recv_into(sock, memoryview(header))
    magic, kind, size = HEADER.unpack(header)
    if magic != MAGIC or kind not in KINDS or size > MAX_HEAD_BYTES:
        raise BulkProtocolError(
            f"not a bulk frame (magic {bytes(magic)!r}, kind {kind}, head of {size} bytes; "
            f"at most {MAX_HEAD_BYTES})"
        )
    head = bytearray(size)
    recv_into(sock, memoryview(head))
    return kind, bytes(head)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the bulk connection closed mid-frame")
        got += n


def plan(tensors) -> tuple[list[tuple[str, np.dtype, tuple[int, ...]]], int]:
    """(name, dtype, shape) of each of ``tensors`` (Tensor messages without content) and the
    bytes they announce in all; TensorDecodeError for a bad dtype or shape or a name twice."""
    metas, total = [], 0
    for tensor in tensors:
        if tensor.content or tensor.offset:
            raise tensor_codec.TensorDecodeError(f"tensor {tensor.name!r}: a bulk head carries no tensor bytes")
        dtype, shape, nbytes = tensor_codec.tensor_meta(tensor)
        total += nbytes
        metas.append((tensor.name, dtype, shape))
    if len({name for name, _, _ in metas}) != len(metas):
        raise tensor_codec.TensorDecodeError("a tensor appears twice in one message")
    return metas, total


def recv_arrays(sock: socket.socket, metas) -> dict[str, np.ndarray]:
    """The bytes of the tensors ``plan`` gave, in that order, each received into an array
    made for it, aligned so that the worker's variables can take it without a copy
    (model/variable_assign.py); bfloat16 ones widened to float32 (--wire_dtype)."""
    out = {}
    for name, dtype, shape in metas:
        array = aligned_empty(shape, dtype)
        if array.nbytes:
            recv_into(sock, array.reshape(-1).view(np.uint8).data)
        out[name] = array.astype(np.float32) if dtype.name == "bfloat16" else array
    return out


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a refused request's tensors): the stream is at a frame again."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        chunk = scratch[:min(nbytes, len(scratch))]
        recv_into(sock, chunk)
        nbytes -= len(chunk)


def tensor_metas(arrays: dict[str, np.ndarray], wire_dtype: str = "float32"):
    """(Tensor messages without content, the arrays as they travel) for ``send_frame``."""
    metas, wire = [], []
    for name, array in arrays.items():
        array = tensor_codec.wire_array(array, wire_dtype)
        metas.append(elasticdl_pb2.Tensor(name=name, dtype=array.dtype.name, shape=array.shape))
        wire.append(array)
    return metas, wire
