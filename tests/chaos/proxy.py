"""A TCP forwarder to etcd that the nemesis can cut and heal again (tests/tcp_proxy.py cuts for good).

Every role of a job reaches etcd through it. ``cut()`` closes every connection and closes each
new one at once, as a partition would; ``heal()`` forwards again, on the same port, so the
job's ``--etcd_endpoints`` stay valid across cuts and master restarts.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:  # k8s_fake is imported from tests/, as the suite's conftest does
    sys.path.append(_TESTS)

from k8s_fake.proxy import _pump as pump  # noqa: E402  (the byte pump of tests/tcp_proxy.py)


class HealableProxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, name="chaos-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            self._drop_all()

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        with self._lock:
            self._closed = self._cut = True
            self._drop_all()
        self._listener.close()

    def _drop_all(self) -> None:
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._sockets = []

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # etcd itself is down: the caller sees a refused connection, as without us
                continue
            with self._lock:
                if self._cut:
                    client.close()
                    upstream.close()
                    continue
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()
