"""The local backend: every role is a child process of the ``elasticdl`` command.

Each child's output goes, line by line, to ``<log_dir>/<role>-<i>.log`` (and, with
``echo``, to the console with a ``[role-i]`` prefix); its pid to ``<log_dir>/<role>-<i>.pid``. Children die with the parent (see ``child.py``) and are
stopped, SIGTERM then SIGKILL, when the job ends or the user presses Ctrl-C.

Warm spares (``warm.py``): ``prewarm`` starts role processes that import their modules
(a worker: TensorFlow) before the job needs them, while the master checks the job;
``start`` hands a spare its command line when one is there, and when it leaves fewer than
the kept number starts a replacement, so that a scale-up or a relaunch also finds one. (Not
at a low CPU priority: a niced spare starved on the loaded benchmark machine and was still
importing when the scale-up came.)
``$ELASTICDL_LOCAL_SPARES`` (default 1) is the number kept per role; 0: no spares at all.

Every child gets the job's token (``token()``) in a 0600 file in a 0700 directory of the
backend's own, named by ``$ELASTICDL_TOKEN_FILE`` in its environment: never on its
command line, which every local user can read. The job key (``job_key()``,
elasticdl/rpc/trust.py) goes the same way to the PS only (``$ELASTICDL_JOB_KEY_FILE``); each
worker gets its own credential instead (``$ELASTICDL_WORKER_CREDENTIAL``; a warm spare, with
its command line on its stdin). All children run as the user who started the job, so locally
this keeps an honest worker from holding what it must not; only separate users (or
Kubernetes pods) make it a boundary against a hostile one.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import grpc

from elasticdl.launch.api import ROLE_ENV, Backend, BackendError, ProcessExit, RoleExitedError
from elasticdl.launch.child import PARENT_PID_ENV
from elasticdl.launch.warm import ROLE_MODULES
from elasticdl.rpc import auth, trust
from elasticdl.rpc.channel import bind_local

logger = logging.getLogger(__name__)

SPARES_ENV = "ELASTICDL_LOCAL_SPARES"


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
    def __init__(self, log_dir: str, echo: bool = False, spares: int | None = None):
        self.log_dir = log_dir
        self.echo = echo
        self._children: dict[tuple[str, int], _Child] = {}
        self.spares = _spares_from_env() if spares is None else spares
        self._spares: dict[str, list[subprocess.Popen]] = {}  # by role: warm, waiting for a command line
        self._kept: dict[str, list[str]] = {}  # roles whose spares are replaced once used: their known args
        self._ready_dir = ""  # 0700: each PS's bound port (see ps_addresses) and the token file
        self._token: str | None = None
        self._token_file = ""
        self._job_key: str | None = None
        self._job_key_file = ""
        os.makedirs(log_dir, exist_ok=True)

    def bind_master(self, server: grpc.Server) -> str:
        return f"127.0.0.1:{bind_local(server)}"

    def _private_dir(self) -> str:
        if not self._ready_dir:
            self._ready_dir = tempfile.mkdtemp(prefix="elasticdl-ps-ready-")  # mode 0700
        return self._ready_dir

    def _ready_file(self, index: int) -> str:
        return os.path.join(self._private_dir(), f"ps-{index}.port")

    def token(self) -> str:
        """The token in ``$ELASTICDL_TOKEN_FILE`` if it is set, else a fresh one for this job."""
        if self._token is None:
            inherited = os.environ.get(auth.TOKEN_FILE_ENV, "")
            if inherited:
                self._token, self._token_file = auth.read_token_file(inherited), os.path.abspath(inherited)
            else:
                self._token = auth.new_token()
        return self._token

    def _child_token_file(self) -> str:
        token = self.token()
        if not self._token_file or not os.path.exists(self._token_file):
            self._token_file = auth.write_private(os.path.join(self._private_dir(), "token"), token + "\n")
        return self._token_file

    def job_key(self) -> str:
        """The key in ``$ELASTICDL_JOB_KEY_FILE`` if it is set, else a fresh one for this job."""
        if self._job_key is None:
            inherited = trust.job_key()
            self._job_key = inherited if inherited is not None else trust.new_job_key()
        return self._job_key

    def _child_job_key_file(self) -> str:
        if not self._job_key_file or not os.path.exists(self._job_key_file):
            self._job_key_file = auth.write_private(
                os.path.join(self._private_dir(), trust.JOB_KEY_FILE_NAME), self.job_key() + "\n")
        return self._job_key_file

    def _role_env(self, role: str, index: int | None) -> dict[str, str]:
        """What only this role instance gets: the PS, the job key; worker ``index``, its credential."""
        if role == "ps":
            return {trust.JOB_KEY_FILE_ENV: self._child_job_key_file()}
        if role == "worker" and index is not None:
            return {trust.WORKER_CREDENTIAL_ENV: trust.worker_credential(self.job_key(), index)}
        return {}

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
        """``priority`` (high/low) only matters on Kubernetes; locally every worker is equal.

        A process of ``role`` ``index`` still running is stopped first: one index is one process
        (two PS on one port would share it, gRPC binding with SO_REUSEPORT, each with its state)."""
        previous = self._children.get((role, index))
        if previous is not None and previous.popen.poll() is None:
            logger.warning("%s-%d is still running (pid %d): stopping it before starting it again", role, index,
                           previous.popen.pid)
            _terminate([previous.popen], 10.0)
        if role == "ps" and "--ready_file" not in args:
            ready = self._ready_file(index)
            if os.path.exists(ready):
                os.remove(ready)  # a relaunched PS announces its new port
            args = [*args, "--ready_file", ready]
        popen = self._use_spare(role, args, self._role_env(role, index)) if not env else None
        if popen is None:
            popen = self._spawn([ROLE_MODULES[role], *args], {**(env or {}), **self._role_env(role, index)})
        log_path = os.path.join(self.log_dir, f"{role}-{index}.log")
        self._children[(role, index)] = _Child(role, index, popen, log_path, self.echo)
        # Beside its log: a spare's command line names no role index, so tools (the chaos
        # tests, the recovery benchmark) find an instance's process here.
        with open(os.path.join(self.log_dir, f"{role}-{index}.pid"), "w") as f:
            f.write(f"{popen.pid}\n")
        logger.debug("started %s-%d (pid %d), log %s", role, index, popen.pid, log_path)

    def prewarm(self, role: str, count: int, known_args: Sequence[str] = ()) -> None:
        """Start ``count`` warm spares of ``role`` now, plus the ``spares`` kept from then on
        (see the module's doc): a replacement started only once a spare is used had 0.7 s
        before the benchmark's scale-up, 3 s short. A spare gets ``known_args`` (e.g. the
        job config, which a worker's spare rehearses with)."""
        if self.spares <= 0:
            return
        self._kept[role] = list(known_args)
        for _ in range(count + self.spares):
            self._start_spare(role)

    def _start_spare(self, role: str) -> None:
        module_args = ["elasticdl.launch.warm", role, *self._kept[role]]
        # A PS spare may hold the job key from its start; a worker's credential names its index,
        # which comes with its command line (_use_spare).
        popen = self._spawn(module_args, self._role_env(role, None), stdin=subprocess.PIPE)
        self._spares.setdefault(role, []).append(popen)
        logger.debug("started a warm %s spare (pid %d)", role, popen.pid)

    def _use_spare(self, role: str, args: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """A spare of ``role`` running ``args`` (its replacement is started), or None."""
        spares = self._spares.get(role, [])
        while spares:
            popen = spares.pop(0)
            if popen.poll() is not None:  # it died: a cold start shows why in the role's log
                continue
            try:
                # With the wall-clock time: the spare's start-up clock runs from here (it may
                # still be importing, and read this line later).
                order = {"args": args, "sent": time.time(), "env": env}  # a pipe: no other process reads it
                popen.stdin.write((json.dumps(order) + "\n").encode())
                popen.stdin.close()
            except (OSError, ValueError):  # it died (its output, if any, was an import error)
                _terminate([popen], 1.0)
                continue
            if role in self._kept and len(spares) < self.spares:
                self._start_spare(role)
            return popen
        return None

    def _spawn(self, module_args: list[str], env: dict[str, str] | None, stdin=subprocess.DEVNULL) -> subprocess.Popen:
        child_env = {**ROLE_ENV, **os.environ, **(env or {})}
        for name in (trust.JOB_KEY_FILE_ENV, trust.WORKER_CREDENTIAL_ENV):  # the master's own, or a user's
            if name not in (env or {}):
                child_env.pop(name, None)
        child_env[PARENT_PID_ENV] = str(os.getpid())
        child_env[auth.TOKEN_FILE_ENV] = self._child_token_file()
        return subprocess.Popen(
            [sys.executable, "-m", *module_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            env=child_env,
            # A group of its own: a terminal's Ctrl-C reaches the command only, which stops its
            # roles in order (a worker hit by SIGINT mid-op could hang in its exit for seconds).
            process_group=0,
        )

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
        """Spares (nothing to lose), workers (they may still be pushing), then the parameter servers."""
        self._kept.clear()
        spares = [p for role in list(self._spares) for p in self._spares.pop(role)]
        for popen in spares:
            popen.stdin.close()  # EOF: a spare that imported its modules leaves by itself
        _terminate(spares, timeout)
        for popen in spares:
            popen.stdout.close()
        for role in ("worker", "ps"):
            _terminate([c.popen for (r, _), c in self._children.items() if r == role], timeout)
        for child in self._children.values():
            child.join_output(1.0)
        if self._ready_dir:
            shutil.rmtree(self._ready_dir, ignore_errors=True)
            self._ready_dir = ""


def _terminate(popens: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM to each, then SIGKILL to those still there ``timeout`` seconds later (one
    deadline for all: waiting ``timeout`` for each in turn added up to n times it)."""
    alive = [p for p in popens if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _spares_from_env() -> int:
    text = os.environ.get(SPARES_ENV, "1").strip()
    try:
        return max(0, int(text))
    except ValueError:
        raise BackendError(f"${SPARES_ENV}={text!r} is not a number: give the warm spares to keep per role "
                           "(0: none)") from None
