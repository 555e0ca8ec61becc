"""A simulated kube-proxy: each service's clusterIP:port forwards TCP to a ready pod it selects.

It listens on every ClusterIP service of the fake API server's store and, per connection,
picks a pod matching the service's selector that is Running, Ready and not terminating.
With no such pod the connection is closed at once (a real cluster refuses it).
"""

from __future__ import annotations

import socket
import threading

from k8s_fake.apiserver import Store


class ServiceProxy:
    def __init__(self, store: Store, poll: float = 0.1):
        self.store = store
        self.poll = poll
        self._listeners: dict[tuple[str, str, str], list[socket.socket]] = {}  # (ns, name, uid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kube-proxy", daemon=True)

    def start(self) -> ServiceProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sockets in self._listeners.values():
            for s in sockets:
                s.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.store.lock:
                services = {(ns, name, o["metadata"]["uid"]): o for (r, ns, name), o in self.store.objects.items()
                            if r == "services" and o["spec"].get("clusterIP") not in (None, "", "None")}
            for key, service in services.items():
                if key not in self._listeners:
                    self._listen(key, service)
            for key in [k for k in self._listeners if k not in services]:
                for s in self._listeners.pop(key):
                    s.close()
            self._stop.wait(self.poll)

    def _listen(self, key, service: dict) -> None:
        sockets = []
        for port in service["spec"]["ports"]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((service["spec"]["clusterIP"], int(port["port"])))
            s.listen(64)
            target = int(port.get("targetPort") or port["port"])
            threading.Thread(target=self._accept, args=(s, key[0], service["spec"].get("selector") or {}, target),
                             daemon=True).start()
            sockets.append(s)
        self._listeners[key] = sockets

    def endpoint(self, ns: str, selector: dict) -> str | None:
        with self.store.lock:
            for (r, n, _), pod in sorted(self.store.objects.items()):
                if r != "pods" or n != ns:
                    continue
                labels = pod["metadata"].get("labels") or {}
                status = pod.get("status") or {}
                ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                            for c in status.get("conditions") or [])
                if (all(labels.get(k) == v for k, v in selector.items()) and status.get("phase") == "Running"
                        and ready and not pod["metadata"].get("deletionTimestamp") and status.get("podIP")):
                    return status["podIP"]
        return None

    def _accept(self, listener: socket.socket, ns: str, selector: dict, port: int) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            ip = self.endpoint(ns, selector)
            try:
                upstream = socket.create_connection((ip, port), timeout=2) if ip else None
            except OSError:
                upstream = None
            if upstream is None:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        src.close()
