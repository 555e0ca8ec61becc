"""The PS's raw-TCP transport for tensor bytes (--tensor_transport tcp): elasticdl/rpc/bulk.py's frames.

It listens beside the gRPC server, on the same host, and serves pulls and pushes of dense
parameters through the same servicer code as their gRPC twins (``PServerServicer.pull_with``
and ``push_arrays``): the same checks, the same answers. A refused request is answered with
an ERROR frame naming gRPC's status (INVALID_ARGUMENT ...) and changes nothing; a frame that
is not one, a wrong token or a request the PS could not read to its end closes the
connection (the worker opens another). One thread per connection: a worker keeps one per PS.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading

import grpc
import numpy as np

from elasticdl.proto import elasticdl_pb2
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import bulk
from elasticdl.rpc import codec as tensor_codec

logger = logging.getLogger(__name__)

# The longest a connection may take to send its token: a caller that says nothing is dropped.
AUTH_TIMEOUT_SECONDS = 10.0
# A refused push's bytes are read (and dropped) up to this much, so that its worker gets the
# answer; a push announcing more closes the connection at once.
MAX_DISCARD_FACTOR, MAX_DISCARD_BYTES = 4, 64 << 20


class _Aborted(Exception):
    """A refused request; ``keep``: the connection is still at a frame (its bytes were read)."""

    def __init__(self, code: grpc.StatusCode, details: str, keep: bool = True):
        super().__init__(details)
        self.code, self.details, self.keep = code, details, keep


class _Context:
    """What the servicer's code needs of a gRPC context: ``abort`` raises, as gRPC's does."""

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)


class BulkServer:
    def __init__(self, servicer: PServerServicer, token: str, host: str = "127.0.0.1"):
        self._servicer = servicer
        self._token = token.encode()
        self._listener = socket.create_server((host, 0))
        self.host, self.port = host, self._listener.getsockname()[1]
        self._stopped = threading.Event()

    def start(self) -> int:
        """Accept connections in a thread; returns the port (also set on the servicer, for its stats)."""
        self._servicer.bulk_host, self._servicer.bulk_port = self.host, self.port
        threading.Thread(target=self._accept, name="bulk-accept", daemon=True).start()
        return self.port

    def stop(self) -> None:
        self._stopped.set()
        try:  # wakes the accept thread: a bare close() leaves it blocked, the port still taking calls
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._servicer.bulk_port = 0

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by stop()
                return
            threading.Thread(target=self._serve, args=(conn,), name="bulk-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                bulk.tune(conn)
                conn.settimeout(AUTH_TIMEOUT_SECONDS)
                kind, head = bulk.recv_head(conn)
                if kind != bulk.AUTH or not hmac.compare_digest(head, self._token):
                    logger.warning("a bulk connection without the job's token was closed")
                    return
                conn.settimeout(None)
                logger.info("raw-TCP connection from %s:%d", *conn.getpeername()[:2])
                while not self._stopped.is_set():
                    kind, head = bulk.recv_head(conn)
                    if not self._answer(conn, kind, head):
                        return
            except (ConnectionError, OSError) as err:  # the worker went, or sent what is not a frame
                if isinstance(err, bulk.BulkProtocolError):
                    logger.warning("bulk connection closed: %s", err)

    def _answer(self, conn: socket.socket, kind: int, head: bytes) -> bool:
        """Serve one request; False when the connection must close (its stream cannot go on)."""
        try:
            if kind == bulk.PULL:
                self._pull(conn, head)
                return True
            if kind == bulk.PUSH:
                self._push(conn, head)
                return True
            raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"frame kind {kind} is not a request", keep=False)
        except _Aborted as err:
            bulk.send_frame(conn, bulk.ERROR, f"{err.code.name}:{err.details}".encode())
            return err.keep

    def _pull(self, conn: socket.socket, head: bytes) -> None:
        try:
            request = elasticdl_pb2.PullDenseParametersRequest.FromString(head)
        except Exception as err:  # protobuf's DecodeError, or a field it refuses
            raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"not a PullDenseParametersRequest: {err}") from None
        answer, arrays = self._servicer.pull_with(request, _Context(), _encode_pull)
        bulk.send_frame(conn, bulk.REPLY, answer, arrays)  # after the PS lock, from the copies

    def _push(self, conn: socket.socket, head: bytes) -> None:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        try:  # a head that cannot be read leaves its tensor bytes unknown: the connection closes
            request = elasticdl_pb2.PushGradientsRequest.FromString(head)
            metas, total = bulk.plan(request.gradients)
        except tensor_codec.TensorDecodeError as err:
            raise _Aborted(invalid, str(err), keep=False) from None
        except Exception as err:  # protobuf's DecodeError, or a field it refuses
            raise _Aborted(invalid, f"not a PushGradientsRequest: {err}", keep=False) from None
        limit = self._servicer.model_bytes
        problem = tensor_codec.wire_dtype_problem(request.wire_dtype)
        if not problem and total > limit:
            problem = f"the tensors hold {total} bytes, more than the {limit} of this PS's model"
        if problem:
            # Its bytes are read and dropped, so that the worker reads the answer: unless there
            # are more than a push could be, which no worker sends.
            keep = total <= MAX_DISCARD_FACTOR * limit + MAX_DISCARD_BYTES
            if keep:
                bulk.discard(conn, total)
            raise _Aborted(invalid, problem, keep=keep)
        grads = bulk.recv_arrays(conn, metas)
        del request.gradients[:]  # read: what is left is the head push_arrays expects
        request.return_parameters = False  # the answer's parameters travel as a pull's
        reply = self._servicer.push_arrays(request, grads, _Context())
        bulk.send_frame(conn, bulk.REPLY, reply.SerializeToString())


def _encode_pull(initialized: bool, version: int, params, wire_dtype: str):
    """Called under the PS lock: the answer's head, and the parameters to send once the lock is
    released: copies (a cast to a reduced ``wire_dtype`` is one)."""
    head = elasticdl_pb2.PullDenseParametersResponse(initialized=initialized, version=version)
    metas, arrays = bulk.tensor_metas(params, wire_dtype)
    head.dense_parameters.extend(metas)
    arrays = [a.copy() if np.may_share_memory(a, live) else a for a, live in zip(arrays, params.values())]
    return head.SerializeToString(), arrays
