"""What the master's job loop needs from a backend: start, watch and stop roles.

The master decides (how many workers, which to relaunch); a backend carries out:
``LocalBackend`` runs each role as a child process, ``KubernetesBackend`` as a pod.
Exits are data (``ProcessExit``), polled by the job loop, never callbacks.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import grpc

from elasticdl.errors import JobFailure
from elasticdl.launch.exits import ProcessExit
from elasticdl.rpc import auth, trust

# The environment of every role process, on every backend (a user's --envs override it).
ROLE_ENV = {
    "PYTHONUNBUFFERED": "1",  # logs reach the master (and kubectl logs) as they are written
    # glibc returns every large buffer (a tensor's bytes, a message) to the kernel and faults
    # it in again on the next allocation; on VMs that costs more than the copy itself. Keeping
    # freed memory in the heap doubles the PS data plane (docs/benchmarks.md).
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
}


class BackendError(JobFailure, RuntimeError):
    """The backend cannot carry out an order; the message says what to fix."""


class RoleExitedError(BackendError):
    """A role ended while the backend waited for it (e.g. a PS that failed to start)."""

    def __init__(self, exit_: ProcessExit):
        super().__init__(f"{exit_.role}-{exit_.index} exited with code {exit_.returncode}")
        self.exit = exit_


class Backend(abc.ABC):
    """Runs the roles of one job. Roles are ``"ps"`` and ``"worker"``; ``index`` names an instance."""

    @abc.abstractmethod
    def start(self, role: str, index: int, args: list[str], env: dict[str, str] | None = None,
              priority: str | None = None) -> None:
        """Start ``role`` ``index`` with the role's command-line ``args`` (and extra ``env``).

        ``priority`` is ``high`` or ``low`` for a worker (None: the backend's default).
        Starting a PS index again (after it exited) relaunches it at the same address."""

    def prewarm(self, role: str, count: int, known_args: Sequence[str] = ()) -> None:
        """Get ready to start ``count`` instances of ``role`` soon, whose command lines will
        begin with ``known_args`` (the local backend starts warm spares: docs/elasticity.md);
        by default nothing. On Kubernetes a new pod's time
        goes to scheduling, pulling the image and starting the container, which no process
        of the master can do ahead."""
        return None

    @abc.abstractmethod
    def running(self, role: str) -> list[int]:
        """Indices of ``role`` that have not exited (starting or running), sorted."""

    @abc.abstractmethod
    def poll_exits(self) -> list[ProcessExit]:
        """Instances that exited since the last call, each reported once."""

    @abc.abstractmethod
    def request_stop(self, role: str, index: int, grace: float = 30.0) -> None:
        """Ask one instance to leave (SIGTERM) without waiting; SIGKILL after ``grace`` seconds.

        Its exit shows up in ``poll_exits``."""

    @abc.abstractmethod
    def stop(self, role: str, index: int, timeout: float = 10.0) -> None:
        """Ask one instance to leave (SIGTERM), kill it after ``timeout`` seconds."""

    @abc.abstractmethod
    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every instance: workers first, then parameter servers."""

    @abc.abstractmethod
    def bind_master(self, server: grpc.Server) -> str:
        """Bind the master's gRPC server where its roles can reach it; returns the address to give them."""

    def token(self) -> str:
        """The job's token: the master's server requires it, its clients send it, and every role
        this backend starts gets it (never on a command line). By default the one in
        ``$ELASTICDL_TOKEN_FILE`` (a pod's mounted Secret); TokenError without one."""
        return auth.require_token("the master")

    def job_key(self) -> str:
        """The job key (elasticdl/rpc/trust.py): the master signs tickets and worker credentials
        with it, and this backend hands it to the PS it starts, never to a worker (each worker
        gets its own credential). By default the one in ``$ELASTICDL_JOB_KEY_FILE`` (the master
        pod's mounted keys Secret); TokenError without one."""
        return trust.require_job_key("the master")

    @abc.abstractmethod
    def ps_addresses(self, num_ps: int, timeout: float) -> list[str]:
        """Wait until PS ``0..num_ps-1`` (already started) serve; their addresses in id order.

        Raises ``RoleExitedError`` when one exits first and ``TimeoutError`` after ``timeout``."""
