"""The master's look at its parameter servers, without waiting on them.

Every ``interval`` seconds the job asks each PS for its stats, in flight. Once every answer (or
error) is in, the probe gives the lowest version (the versions no worker reports) and which PS
did not answer within ``deadline``: a PS that is frozen or hung (a gray failure) is silent, not
dead, and the controller replaces it once the silence lasted (``PSSilent``). A PS that is down
(connection refused, being relaunched) is not silent: its exit tells.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from elasticdl.master.events import PSSilent, VersionReported
from elasticdl.rpc.ps_client import PSClient, PSStats, stats_of

# How long one probe waits for a PS: far above a busy PS's answer, far below the silence that
# gets it replaced (controller.PS_SILENT_SECONDS).
PROBE_DEADLINE_SECONDS = 5.0


class PSProbe:
    def __init__(self, ps: PSClient, interval: float, clock: Callable[[], float],
                 on_stats: Callable[[list[PSStats]], None] = lambda stats: None):
        self._ps = ps
        self._interval = interval
        self._clock = clock
        self._on_stats = on_stats  # every PS answered: e.g. log failed checkpoint writes
        self._futures: list[grpc.Future] | None = None
        self._last = float("-inf")

    def poll(self) -> list:
        """The events of a probe that completed (none while one is in flight); starts the next."""
        events: list = []
        if self._futures is not None and all(f.done() for f in self._futures):
            events = self._collect(self._futures)
            self._futures = None
        now = self._clock()
        if self._futures is None and now - self._last >= self._interval:
            self._futures = self._ps.stats_futures(PROBE_DEADLINE_SECONDS)
            self._last = now
        return events

    def _collect(self, futures: list[grpc.Future]) -> list:
        stats, silent = [], []
        for index, future in enumerate(futures):
            try:
                stats.append(stats_of(future.result()))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    silent.append(index)
        events: list = [PSSilent(tuple(silent))]
        if len(stats) == len(futures):
            self._on_stats(stats)
            events.append(VersionReported(min(s.version for s in stats)))
        return events
