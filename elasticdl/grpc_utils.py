"""gRPC channel and server settings shared by every role."""

from __future__ import annotations

import os
from concurrent import futures

import grpc

from elasticdl import security

# Whole models travel in one message for now; raise the 4 MB default.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
POD_IP_ENV = "ELASTICDL_POD_IP"
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_server(max_workers: int = 16) -> grpc.Server:
    """In a cluster (a job token is mounted) the server refuses calls without the token."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS,
        interceptors=security.server_interceptors(),
    )


def bind_local(server: grpc.Server, port: int = 0) -> int:
    """Bind to 127.0.0.1 only (local mode never listens on other interfaces); returns the port."""
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    return bound


def bind_role(server: grpc.Server, port: int = 0) -> int:
    """127.0.0.1 locally; in a Kubernetes pod its own IP (ELASTICDL_POD_IP, from the pod spec)."""
    host = os.environ.get(POD_IP_ENV, "")
    if not host:
        return bind_local(server, port)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def make_channel(address: str) -> grpc.Channel:
    """In a cluster every call carries the job's token (see elasticdl/security.py)."""
    return security.secure_channel(grpc.insecure_channel(address, options=_OPTIONS))


def wait_for_channel(channel: grpc.Channel, address: str, timeout: float) -> None:
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError as err:
        raise ConnectionError(f"no server answered at {address} within {timeout:.0f}s") from err
