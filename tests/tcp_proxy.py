"""A TCP forwarder on loopback that a test can cut, to partition one process from a server."""

from __future__ import annotations

import socket
import threading

from k8s_fake.proxy import _pump as pump  # the same byte pump as the fake kube-proxy


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``cut()`` closes every connection and refuses new ones."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cut_event = threading.Event()
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self.cut_event.set()
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _accept(self) -> None:
        while not self.cut_event.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self.cut_event.is_set():
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()
