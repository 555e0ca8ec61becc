"""gRPC channel and server settings shared by every role."""

from __future__ import annotations

from concurrent import futures

import grpc

# Whole models travel in one message for now; raise the 4 MB default.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_server(max_workers: int = 16) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)


def bind_local(server: grpc.Server, port: int = 0) -> int:
    """Bind to 127.0.0.1 only (local mode never listens on other interfaces); returns the port."""
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    return bound


def make_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=_OPTIONS)


def wait_for_channel(channel: grpc.Channel, address: str, timeout: float) -> None:
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError as err:
        raise ConnectionError(f"no server answered at {address} within {timeout:.0f}s") from err
