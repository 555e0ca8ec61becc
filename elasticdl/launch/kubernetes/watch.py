"""Watching a job's pods: one list-then-watch pass, and a reconnect shell around it.

``watch_pass`` lists the pods (a full snapshot, delivered as one ``SYNC``), then watches
from the list's resourceVersion, delivering every event, and returns the last version
it saw when the server ends the watch. ``PodWatchLoop.run`` keeps calling it: after a
timeout it watches on from the last version; after ``410 Gone`` or any error it lists
again (with a backoff), so no change is ever missed for long.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elasticdl.launch.kubernetes.client import K8sClient, K8sError, K8sGone

logger = logging.getLogger(__name__)

Handler = Callable[[str, object], None]  # ("SYNC", [pods]) or (event type, pod)


def watch_pass(client: K8sClient, selector: str, handler: Handler, resource_version: str = "",
               timeout_seconds: int = 30, on_response=None) -> str:
    """List (when ``resource_version`` is empty), then watch; returns the last resourceVersion."""
    if not resource_version:
        pods, resource_version = client.list_pods(selector)
        handler("SYNC", pods)
    for kind, obj in client.watch_pods(selector, resource_version, timeout_seconds, on_response):
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            resource_version = version
        if kind != "BOOKMARK":
            handler(kind, obj)
    return resource_version


class PodWatchLoop:
    """Runs ``watch_pass`` on a thread until ``stop()``; reconnects on timeouts, 410 and errors."""

    def __init__(self, client: K8sClient, selector: str, handler: Handler, timeout_seconds: int = 30,
                 max_backoff: float = 10.0):
        self.client, self.selector, self.handler = client, selector, handler
        self.timeout_seconds = timeout_seconds
        self.max_backoff = max_backoff
        self.relists = 0  # how many times it listed (1 + reconnects after 410 or errors)
        self.synced = threading.Event()  # set after the first list
        self._stop = threading.Event()
        self._response = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="elasticdl-pod-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the read of a long watch
            except Exception:
                pass
        if self._thread is not None:
            self._thread.join(5)

    def _on_response(self, response) -> None:
        self._response = response

    def _handle(self, kind: str, obj) -> None:
        self.handler(kind, obj)
        if kind == "SYNC":
            self.relists += 1
            self.synced.set()

    def run(self) -> None:
        version, backoff = "", 0.5
        while not self._stop.is_set():
            try:
                version = watch_pass(self.client, self.selector, self._handle, version,
                                     self.timeout_seconds, self._on_response)
                backoff = 0.5
            except K8sGone:
                logger.info("pod watch: resourceVersion %s expired (410 Gone); listing again", version)
                version = ""
            except Exception as err:  # connection reset, API restart, ...
                if self._stop.is_set():
                    break
                level = logging.WARNING if isinstance(err, K8sError) else logging.INFO
                logger.log(level, "pod watch interrupted (%s); listing again in %.1fs", err, backoff)
                version = ""
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)
            finally:
                self._response = None
