"""StartupClock: where a worker's time to its first gradient goes (a join is only as cheap as this).

A worker logs, with its first pushed gradient, the seconds since its process started and each
phase's share ("first gradient after 2.91s: python 0.05, tensorflow 1.80, ..."); the scale-up
benchmark and docs/benchmarks.md ("where the time goes") read that line.
"""

from __future__ import annotations

import os
import time


def process_age() -> float:
    """Seconds since this process was started (by the kernel's clock; 0.0 where unknown)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (after the command in parentheses, which may hold spaces): start ticks since boot.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupClock:
    """Phases of a worker's start, each timed from the end of the one before.

    >>> clock = StartupClock(started=time.monotonic() - 1.0)
    >>> clock.mark("tensorflow")
    >>> clock.phases["tensorflow"] >= 1.0, clock.done
    (True, False)
    """

    def __init__(self, started: float | None = None, origin: str = "the process started"):
        # Before this object existed: the interpreter and the first imports ("python"); a
        # warm spare's clock starts when it gets its command line (its imports were done).
        self._origin = origin
        self._started = time.monotonic() - process_age() if started is None else started
        self._last = self._started
        self.phases: dict[str, float] = {}
        self.done = False

    def mark(self, phase: str) -> None:
        """``phase`` ended now (a phase marked again adds up, e.g. several tries)."""
        if self.done:
            return
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def finish(self) -> str:
        """Stop the clock; the log line's text: total seconds and each phase's."""
        self.done = True
        total = self._last - self._started
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases.items())
        return f"{total:.2f}s since {self._origin} ({parts})"
