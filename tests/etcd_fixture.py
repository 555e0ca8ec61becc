"""A real etcd server for tests: free loopback ports, a temporary data dir, stopped after.

``etcd_server`` (session-wide) yields the client endpoint, ``"127.0.0.1:<port>"``; tests
sharing it use distinct job names. ``etcd_process`` is a server of the test's own that the
test may stop, kill and start again on the same ports and data dir (outages, restarts).

Without the ``etcd`` binary (Debian: ``apt-get install etcd-server``) the tests that need
it are skipped, except in CI (``CI=true``), where they fail: CI must exercise etcd.
``ELASTICDL_ETCD_BINARY`` points to another binary.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import pytest

START_TIMEOUT = 20.0


def etcd_binary() -> str | None:
    return os.environ.get("ELASTICDL_ETCD_BINARY") or shutil.which("etcd")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_etcd() -> str:
    """The etcd binary, or skip (fail in CI) with what to install."""
    binary = etcd_binary()
    if binary is None:
        why = "the etcd binary is not on PATH (Debian/Ubuntu: apt-get install etcd-server)"
        if _in_ci():
            pytest.fail(f"{why}; CI must run the etcd tests (.ci/run installs it)", pytrace=False)
        pytest.skip(why)
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    """One single-member etcd; ``start``/``stop``/``kill`` keep the ports and the data dir."""

    def __init__(self, binary: str, data_dir: str):
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.popen: subprocess.Popen | None = None
        self.log_path = os.path.join(data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, timeout: float = START_TIMEOUT) -> None:
        assert not self.running, "etcd is already running"
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name", "test",
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--initial-cluster-state", "new",
            # A fast single-member election; also lowers the minimum lease TTL to 1 s.
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--log-level", "warn",
            "--logger", "zap",
        ]
        log = open(self.log_path, "ab")
        try:
            self.popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.client_port}/health"
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.popen.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if b'"health":"true"' in response.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd was not healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after ``timeout``)."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash. Acknowledged writes survive (etcd fsyncs its WAL first)."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout: float) -> None:
        if not self.running:
            return
        self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def log_tail(self, lines: int = 20) -> str:
        return tail_of(self.log_path, lines)


def tail_of(path: str, lines: int = 20) -> str:
    """The last ``lines`` of a server's log ('' when it cannot be read): for a failure message."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _etcd(tmp_dir: str) -> Iterator[EtcdProcess]:
    process = EtcdProcess(require_etcd(), tmp_dir)
    try:
        process.start()
    except RuntimeError:
        # A port taken between choosing it and etcd binding it: choose again, once.
        process = EtcdProcess(process.binary, tempfile.mkdtemp(dir=tmp_dir))
        process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory) -> Iterator[str]:
    """The endpoint (``host:port``) of an etcd shared by the session; use your own job name."""
    for process in _etcd(str(tmp_path_factory.mktemp("etcd"))):
        yield process.endpoint


@pytest.fixture
def etcd_process(tmp_path) -> Iterator[EtcdProcess]:
    """An etcd of the test's own, to stop, kill and restart."""
    yield from _etcd(str(tmp_path))
