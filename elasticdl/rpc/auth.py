"""Per-job token authentication for every gRPC call, in every mode (fail closed).

Every job has one random token. Every gRPC server of the job (the master, each PS) is
made with it and refuses a call without that exact token with ``UNAUTHENTICATED``,
before the servicer runs, so a refused call changes nothing; a server is never made
without a token (``TokenError``: it would serve anyone who can reach its port). Every
channel sends ``authorization: Bearer <token>``.

Where the token comes from:

- on Kubernetes, the client makes it and keeps it in the job's Secret, mounted into every
  pod; ``$ELASTICDL_TOKEN_FILE`` names the mounted file;
- in local mode, the master makes it (or takes ``$ELASTICDL_TOKEN_FILE`` if set) and hands
  it to the PS and workers it starts as a 0600 file named in their environment, never on
  their command line; it also writes ``runs/<job>/token`` (0600) beside ``master.addr`` for
  ``elasticdl scale``.

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
import stat
import tempfile

import grpc

from elasticdl.errors import JobFailure

TOKEN_FILE_ENV = "ELASTICDL_TOKEN_FILE"
TOKEN_FILE_NAME = "token"  # runs/<job>/token, beside master.addr (local mode)
METADATA_KEY = "authorization"
_PREFIX = "Bearer "


class TokenError(JobFailure, RuntimeError):
    """A role has no readable token (its Secret is not mounted, the file is missing, empty or
    readable by every user): it cannot talk to the others, and must not serve, so the job
    cannot go on."""


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def read_token_file(path: str, source: str = TOKEN_FILE_ENV) -> str:
    """The token in ``path``; TokenError if it cannot be read, is empty or is world-readable."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except OSError as err:
        raise TokenError(
            f"{source}={path} cannot be read ({err}); the job's token is not there (on Kubernetes: its "
            "Secret is not mounted)"
        ) from err
    if mode & stat.S_IROTH:
        raise TokenError(
            f"{source}={path} is readable by every user (mode {stat.S_IMODE(mode):04o}), so the token "
            f"guards nothing: chmod 600 {path}"
        )
    if not token:
        raise TokenError(f"{source}={path} is empty; the job's token file (or Secret) holds no token")
    return token


def job_token() -> str | None:
    """The token in the file ``$ELASTICDL_TOKEN_FILE`` names, or None when it is not set."""
    path = os.environ.get(TOKEN_FILE_ENV, "")
    return read_token_file(path) if path else None


def require_token(who: str) -> str:
    """The job's token for ``who`` (a role about to serve or call), or a TokenError saying why not."""
    token = job_token()
    if token is None:
        raise TokenError(
            f"{who} refuses to start without the job's token: ${TOKEN_FILE_ENV} is not set. The master "
            "hands the token to the PS and workers it starts (on Kubernetes, through the job's Secret); "
            f"to start one by hand, set ${TOKEN_FILE_ENV} to a 0600 file holding the job's token"
        )
    return token


def write_private(path: str, text: str) -> str:
    """Write ``text`` to ``path`` readable by its owner only (0600), atomically, whatever was there."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", text=True)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def ensure_process_token(directory: str) -> str:
    """The token of ``$ELASTICDL_TOKEN_FILE``; without one, a fresh token written to
    ``<directory>/token`` (0600) and named in this process's environment, for the servers it
    makes and the processes it starts (benchmarks and tools that are no ``Job``)."""
    token = job_token()
    if token is None:
        token = new_token()
        os.makedirs(directory, exist_ok=True)
        os.environ[TOKEN_FILE_ENV] = write_private(os.path.join(directory, "token"), token + "\n")
    return token


def server_interceptors(token: str) -> list[grpc.ServerInterceptor]:
    if not token:
        raise TokenError("a gRPC server needs the job's token: it would serve anyone who can reach it")
    return [TokenAuthInterceptor(token)]


def secure_channel(channel: grpc.Channel, token: str | None = None) -> grpc.Channel:
    """``channel`` sending ``token`` (default: the job's) with every call. Without any token
    the channel sends none, and every server of a job refuses its calls (UNAUTHENTICATED)."""
    token = token or job_token()
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


class HeaderCallInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the metadata ``key: value`` to every outgoing call."""

    def __init__(self, key: str, value: str):
        self._header = (key, value)

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


class TokenCallInterceptor(HeaderCallInterceptor):
    """Adds the job's token to every outgoing call."""

    def __init__(self, token: str):
        super().__init__(METADATA_KEY, _PREFIX + token)
