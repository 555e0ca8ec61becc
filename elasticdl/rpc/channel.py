"""gRPC channel and server settings shared by every role."""

from __future__ import annotations

import os
from concurrent import futures

import grpc

from elasticdl.rpc import auth as security

# Large models stream in 1 MB messages (the PS's *_stream methods); other messages, such as a
# whole model pushed once at the start, may still be large: raise the 4 MB default.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
POD_IP_ENV = "ELASTICDL_POD_IP"
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_server(max_workers: int = 16, token: str | None = None) -> grpc.Server:
    """A server that refuses every call without the job's token (UNAUTHENTICATED).

    ``token`` defaults to the one in ``$ELASTICDL_TOKEN_FILE``; with neither, no server is
    made (``auth.TokenError``): whatever address it is bound to, it fails closed.
    """
    token = token or security.require_token("a gRPC server of the job")
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS,
        interceptors=security.server_interceptors(token),
    )


def bind_local(server: grpc.Server, port: int = 0) -> int:
    """Bind to 127.0.0.1 only (local mode never listens on other interfaces); returns the port."""
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    return bound


def bind_role(server: grpc.Server, port: int = 0) -> int:
    """127.0.0.1 locally; in a Kubernetes pod its own IP (ELASTICDL_POD_IP, from the pod spec).

    Either way the server came from ``make_server``, so it serves only callers with the token.
    """
    host = os.environ.get(POD_IP_ENV, "")
    if not host:
        return bind_local(server, port)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def make_channel(address: str, token: str | None = None) -> grpc.Channel:
    """Every call carries ``token`` (default: the job's, see elasticdl/rpc/auth.py)."""
    return security.secure_channel(grpc.insecure_channel(address, options=_OPTIONS), token)


def wait_for_channel(channel: grpc.Channel, address: str, timeout: float) -> None:
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError as err:
        raise ConnectionError(f"no server answered at {address} within {timeout:.0f}s") from err


def _serialize(message) -> bytes:
    """Messages are serialized as usual; bytes pass through (see tensor_codec.serialize_with_tensors)."""
    return message if isinstance(message, (bytes, bytearray)) else message.SerializeToString()


def _service(service_name: str):
    """(full name, [(method, request class, response class)]) of a service of elasticdl.proto."""
    from google.protobuf import message_factory

    from elasticdl.proto import elasticdl_pb2

    service = elasticdl_pb2.DESCRIPTOR.services_by_name[service_name]
    return service.full_name, [
        (m, message_factory.GetMessageClass(m.input_type), message_factory.GetMessageClass(m.output_type))
        for m in service.methods
    ]


def _kind(method) -> str:
    """``unary_unary``, ``unary_stream``, ``stream_unary`` or ``stream_stream``, as gRPC names them."""
    return f"{'stream' if method.client_streaming else 'unary'}_{'stream' if method.server_streaming else 'unary'}"


def add_service(server: grpc.Server, service_name: str, servicer) -> None:
    """Serve ``servicer``'s methods for a service of elasticdl.proto.

    Like the generated ``add_<Service>Servicer_to_server``, except that a method may return
    its response already serialized (the PS writes tensors straight into the reply bytes),
    and the methods a servicer names in ``RAW_REQUESTS`` get their requests as bytes (it
    parses them itself, see ``tensor_codec.parse_with_tensors``).
    """
    full_name, methods = _service(service_name)
    raw = getattr(servicer, "RAW_REQUESTS", frozenset())
    handlers = {}
    for method, request_class, _ in methods:
        make = getattr(grpc, f"{_kind(method)}_rpc_method_handler")
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=None if method.name in raw else request_class.FromString,
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(full_name, handlers),))


class ServiceStub:
    """Like the generated ``<Service>Stub``, except that a request may be passed already
    serialized, and the methods in ``raw_responses`` answer in bytes."""

    def __init__(self, channel: grpc.Channel, service_name: str, raw_responses: frozenset[str] = frozenset()):
        full_name, methods = _service(service_name)
        for method, _, response_class in methods:
            make = getattr(channel, _kind(method))
            setattr(self, method.name, make(
                f"/{full_name}/{method.name}",
                request_serializer=_serialize,
                response_deserializer=None if method.name in raw_responses else response_class.FromString,
            ))
