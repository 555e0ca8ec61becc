"""What a backend reports of a role that ended: plain data, shared by the backends, the
master's controller and the simulator (which must not pull in the wire to read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessExit:
    """A role instance that ended. ``returncode`` follows ``subprocess``: negative for a signal
    (a pod's ``137`` becomes ``-9``); ``reason`` says why when the backend knows (Kubernetes:
    ``Deleted``, ``Evicted``, ``OOMKilled``, ``ImagePullBackOff``, ...)."""

    role: str
    index: int
    returncode: int
    log_tail: str
    reason: str = ""
