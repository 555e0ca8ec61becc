"""The local backend: every role is a child process of the ``elasticdl`` command.

Each child's output goes, line by line, to ``<log_dir>/<role>-<i>.log`` (and, with
``echo``, to the console with a ``[role-i]`` prefix). Children die with the parent (see ``child.py``) and are
stopped, SIGTERM then SIGKILL, when the job ends or the user presses Ctrl-C.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from elasticdl.launch.api import ROLE_ENV, Backend, ProcessExit, RoleExitedError
from elasticdl.launch.child import PARENT_PID_ENV
from elasticdl.rpc.channel import bind_local

logger = logging.getLogger(__name__)

_MODULES = {"ps": "elasticdl.ps.main", "worker": "elasticdl.worker.main"}


__all__ = ["LocalBackend", "ProcessExit"]  # ProcessExit lives in backends/api.py


class _Child:
    def __init__(self, role: str, index: int, popen: subprocess.Popen, log_path: str, echo: bool):
        self.role, self.index, self.popen, self.log_path = role, index, popen, log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.reported = False
        self.kill_at: float | None = None  # request_stop's deadline
        self._thread = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def _pump(self, echo: bool) -> None:
        prefix = f"[{self.name}] "
        with open(self.log_path, "a", encoding="utf-8") as log:
            for raw in self.popen.stdout:
                line = raw.decode("utf-8", errors="replace")
                self.tail.append(line)
                log.write(line)  # the file name says which role; no prefix needed
                log.flush()
                if echo:
                    sys.stderr.write(prefix + line)

    def join_output(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


class LocalBackend(Backend):
    def __init__(self, log_dir: str, echo: bool = False):
        self.log_dir = log_dir
        self.echo = echo
        self._children: dict[tuple[str, int], _Child] = {}
        self._ready_dir = ""  # where each PS writes its bound port (see ps_addresses)
        os.makedirs(log_dir, exist_ok=True)

    def bind_master(self, server: grpc.Server) -> str:
        return f"127.0.0.1:{bind_local(server)}"

    def _ready_file(self, index: int) -> str:
        if not self._ready_dir:
            self._ready_dir = tempfile.mkdtemp(prefix="elasticdl-ps-ready-")
        return os.path.join(self._ready_dir, f"ps-{index}.port")

    def ps_addresses(self, num_ps: int, timeout: float) -> list[str]:
        files = [self._ready_file(i) for i in range(num_ps)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for exit_ in self.poll_exits():
                raise RoleExitedError(exit_)
            if all(os.path.exists(f) for f in files):
                return [f"127.0.0.1:{int(open(f).read())}" for f in files]
            time.sleep(0.05)
        raise TimeoutError(f"parameter servers did not start within {timeout:.0f}s")

    def start(self, role: str, index: int, args: list[str], env: dict[str, str] | None = None,
              priority: str | None = None) -> None:
        """``priority`` (high/low) only matters on Kubernetes; locally every worker is equal."""
        if role == "ps" and "--ready_file" not in args:
            ready = self._ready_file(index)
            if os.path.exists(ready):
                os.remove(ready)  # a relaunched PS announces its new port
            args = [*args, "--ready_file", ready]
        child_env = {**ROLE_ENV, **os.environ, **(env or {})}
        child_env[PARENT_PID_ENV] = str(os.getpid())
        popen = subprocess.Popen(
            [sys.executable, "-m", _MODULES[role], *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
        )
        log_path = os.path.join(self.log_dir, f"{role}-{index}.log")
        self._children[(role, index)] = _Child(role, index, popen, log_path, self.echo)
        logger.debug("started %s-%d (pid %d), log %s", role, index, popen.pid, log_path)

    def pid(self, role: str, index: int) -> int:
        return self._children[(role, index)].popen.pid

    def running(self, role: str) -> list[int]:
        return sorted(i for (r, i), c in self._children.items() if r == role and c.popen.poll() is None)

    def poll_exits(self) -> list[ProcessExit]:
        """Children that exited since the last call."""
        exits = []
        for child in self._children.values():
            if child.kill_at is not None and time.monotonic() > child.kill_at and child.popen.poll() is None:
                logger.warning("%s did not leave within its grace period: killing it", child.name)
                child.popen.kill()
            code = child.popen.poll()
            if code is not None and not child.reported:
                child.reported = True
                child.join_output()
                exits.append(ProcessExit(child.role, child.index, code, "".join(child.tail)))
        return exits

    def request_stop(self, role: str, index: int, grace: float = 30.0) -> None:
        """SIGTERM now (a worker finishes its batch, reports and leaves); SIGKILL after ``grace``.

        Does not wait: the exit shows up in ``poll_exits``.
        """
        child = self._children.get((role, index))
        if child is not None and child.popen.poll() is None:
            child.popen.send_signal(signal.SIGTERM)
            child.kill_at = time.monotonic() + grace

    def stop(self, role: str, index: int, timeout: float = 10.0) -> None:
        child = self._children.get((role, index))
        if child is not None:
            _terminate([child.popen], timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Workers first (they may still be pushing), then the parameter servers."""
        for role in ("worker", "ps"):
            _terminate([c.popen for (r, _), c in self._children.items() if r == role], timeout)
        for child in self._children.values():
            child.join_output(1.0)
        if self._ready_dir:
            shutil.rmtree(self._ready_dir, ignore_errors=True)
            self._ready_dir = ""


def _terminate(popens: list[subprocess.Popen], timeout: float) -> None:
    alive = [p for p in popens if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    for p in alive:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
