"""Per-job token authentication for every gRPC call in a cluster.

In local mode every server binds to 127.0.0.1 and no token is needed. On Kubernetes the
client makes a random token per job and keeps it in a Secret that is mounted into every
pod of the job; ``ELASTICDL_TOKEN_FILE`` names the mounted file. Then:

- every channel from ``grpc_utils.make_channel`` sends ``authorization: Bearer <token>``;
- every server from ``grpc_utils.make_server`` refuses a call without that exact token
  with ``UNAUTHENTICATED``, before the servicer runs, so a refused call changes nothing.

Example::

    token = new_token()
    server = grpc.server(pool, interceptors=[TokenAuthInterceptor(token)])
    channel = grpc.intercept_channel(grpc.insecure_channel(addr), TokenCallInterceptor(token))
"""

from __future__ import annotations

import collections
import hmac
import os
import secrets

import grpc

from elasticdl.errors import JobFailure

TOKEN_FILE_ENV = "ELASTICDL_TOKEN_FILE"
METADATA_KEY = "authorization"
_PREFIX = "Bearer "


class TokenError(JobFailure, RuntimeError):
    """A pod of the job has no readable token (its Secret is not mounted, or empty): it cannot
    talk to the others, so the job cannot go on."""


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def job_token() -> str | None:
    """The token of the job this process belongs to, or None outside a cluster (local mode)."""
    path = os.environ.get(TOKEN_FILE_ENV, "")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as err:
        raise TokenError(
            f"{TOKEN_FILE_ENV}={path} cannot be read ({err}); the job's token Secret is not mounted"
        ) from err
    if not token:
        raise TokenError(f"{TOKEN_FILE_ENV}={path} is empty; the job's token Secret holds no token")
    return token


def server_interceptors() -> list[grpc.ServerInterceptor]:
    token = job_token()
    return [TokenAuthInterceptor(token)] if token else []


def secure_channel(channel: grpc.Channel) -> grpc.Channel:
    token = job_token()
    return grpc.intercept_channel(channel, TokenCallInterceptor(token)) if token else channel


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks the job's token."""

    def __init__(self, token: str):
        self._expected = (_PREFIX + token).encode()

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _refusing_handler(handler, handler_call_details.method)


def _refusing_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: missing or wrong job token")

    def refuse_stream(request_or_iterator, context):
        refuse(request_or_iterator, context)
        yield  # never reached: a generator, as streaming handlers must be

    # Requests are not even parsed: raw bytes in, nothing out.
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class TokenCallInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the job's token to every outgoing call."""

    def __init__(self, token: str):
        self._header = (METADATA_KEY, _PREFIX + token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
