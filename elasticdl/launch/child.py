"""Helpers for processes a local backend starts: die with the parent, never outlive it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

PARENT_PID_ENV = "ELASTICDL_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, even on kill -9).

    Called first thing in a child's main; then the parent pid is compared with the one the
    parent recorded, since the parent may have died before the request was made.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected:
        return  # not started by the local backend (e.g. a Kubernetes pod)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: fall back to the parent's clean-up
    if os.getppid() != int(expected):
        os._exit(1)



def exit_now(code: int) -> NoReturn:
    """End a role's process with ``code`` once its work is done, without the interpreter's
    finalization: with TensorFlow loaded, its garbage collection of every object and the
    libraries' exit hooks take seconds, during which the job (and its user) waits for the role
    to leave, and nothing in it is needed (the role reported its results over RPC and closed
    what it wrote). Log handlers and the standard streams are flushed first."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
