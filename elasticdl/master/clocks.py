"""Worker clocks for stale-synchronous parallel training.

A worker's clock counts the batches it pushed. Only workers that hold a task count
towards the slowest clock, so a dead, preempted or idle worker never holds the others
back. A worker that joins (or comes back from idling) starts at the slowest active
worker's clock rather than at its own, lower count, so it does not stall everyone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ClockView:
    clock: int  # the reporting worker's clock as the master counts it
    slowest: int  # among workers holding a task
    fastest: int


class WorkerClocks:
    def __init__(self):
        self._lock = threading.Lock()
        self._clock: dict[int, int] = {}
        self._offset: dict[int, int] = {}
        self._rejoining: set[int] = set()
        self.blocked_seconds = 0.0

    def report(self, worker_id: int, raw_clock: int, active: set[int], blocked_seconds: float = 0.0) -> ClockView:
        with self._lock:
            self.blocked_seconds += blocked_seconds
            self._rejoining |= set(self._clock) - active
            others = [c for w, c in self._clock.items() if w in active and w != worker_id]
            if worker_id not in self._offset or worker_id in self._rejoining:
                floor = min(others) if others else raw_clock
                self._offset[worker_id] = max(self._offset.get(worker_id, 0), floor - raw_clock)
                self._rejoining.discard(worker_id)
            clock = raw_clock + self._offset[worker_id]
            self._clock[worker_id] = clock
            live = others + [clock]
            return ClockView(clock, min(live), max(live))

    def forget(self, worker_id: int) -> None:
        """A worker that is gone for good."""
        with self._lock:
            self._clock.pop(worker_id, None)
            self._offset.pop(worker_id, None)
            self._rejoining.discard(worker_id)
