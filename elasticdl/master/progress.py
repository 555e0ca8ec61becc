"""Training progress as the user sees it: epoch, records done / total, loss, examples/s.

Two rates: the current one, over the last ``RATE_WINDOW_SECS`` (what ``elasticdl scale`` or a
lost worker changes shows within seconds), and the average since the start. The loss is shown
with 4 significant digits (a loss of 1e-5 is not ``0.0000``).

On a terminal the progress is one live line at the bottom (``rich.live.Live``); log lines
print above it, never glued onto it (the console log handler writes to the current
``sys.stderr``, which the live display proxies). Elsewhere (a file, a pipe) it is a plain
line each time it is rendered. Either way, once training is done the last line is written
once and never again.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

# The window of the current rate: long enough to hold a few task reports of every worker
# (a task is some hundreds of records, a report every second or two), short enough that a
# scale-up shows within it.
RATE_WINDOW_SECS = 10.0


class TrainingProgress:
    """Fed by task reports (any thread); rendered by the job loop."""

    def __init__(self, records_per_epoch: int, num_epochs: int, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.records_per_epoch = records_per_epoch
        self.num_epochs = num_epochs
        self._stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._clock = clock
        self._started = clock()
        self._last_record = self._started  # examples/s counts to the last report, not to now
        self._reports: collections.deque[tuple[float, int]] = collections.deque()  # (time, records), in the window
        self.records_trained = 0  # every record a worker reported, repeats included
        self.loss_sum = 0.0
        self.batches = 0
        self.recent_loss: float | None = None
        self.model_version = 0
        self.is_tty = self._stream.isatty()
        self._live = None  # the rich Live display, on a terminal, while training runs
        self.done = False  # the final line was written: nothing is rendered after it
        self.lag: int | None = None  # a stream's consumer lag (records behind the partitions' ends); None: files

    def record(self, records: int, loss_sum: float, batches: int, model_version: int) -> None:
        with self._lock:
            self.records_trained += records
            self.loss_sum += loss_sum
            self.batches += batches
            if batches:
                self.recent_loss = loss_sum / batches
            self.model_version = max(self.model_version, model_version)
            if records:
                self._last_record = self._clock()
                self._reports.append((self._last_record, records))
                self._forget_before(self._last_record - RATE_WINDOW_SECS)

    def _forget_before(self, start: float) -> None:
        while self._reports and self._reports[0][0] <= start:
            self._reports.popleft()

    @property
    def examples_per_second(self) -> float:
        """Records trained per second, from the master's start to the last task report (so the
        figure does not sink while the job waits for evaluation or for workers to leave)."""
        elapsed = self._last_record - self._started
        return self.records_trained / elapsed if elapsed > 0 else 0.0

    @property
    def current_rate(self) -> float:
        """Records trained per second over the last ``RATE_WINDOW_SECS`` up to now (0 when no
        task was reported in that window), or since the start when that is shorter."""
        now = self._clock()
        with self._lock:
            self._forget_before(now - RATE_WINDOW_SECS)
            records = sum(n for _, n in self._reports)
        span = min(RATE_WINDOW_SECS, now - self._started)
        return records / span if span > 0 else 0.0

    def line(self, epoch: int, records_done: int) -> str:
        # Significant digits, not decimals: a loss of 1e-5 must not read as 0.0000.
        loss = "-" if self.recent_loss is None else f"{self.recent_loss:.4g}"
        total = self.records_per_epoch
        width = 10  # the line fits in about 80 columns
        # Clamped: the ledger never counts more than an epoch holds, but the bar must not grow
        # with whatever number it is given.
        filled = min(width, max(0, int(width * records_done / total))) if total else width
        bar = "#" * filled + "." * (width - filled)
        lag = "" if self.lag is None else f"  lag {self.lag:,}"
        return (
            f"epoch {epoch + 1}/{self.num_epochs} [{bar}] {records_done}/{total}  "
            f"loss {loss}  {self.current_rate:,.0f} examples/s (avg {self.examples_per_second:,.0f})  "
            f"version {self.model_version}{lag}"
        )

    def render(self, epoch: int, records_done: int, final: bool = False) -> None:
        """On a terminal, the live line; in a log, a plain line per call. ``final``: the last one."""
        if self.done:
            return
        text = self.line(epoch, records_done)
        if self.is_tty:
            self._render_live(text)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()
        if final:
            self.close()

    def _render_live(self, text: str) -> None:
        from rich.text import Text

        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self._stream, highlight=False, soft_wrap=True)
            # redirect_stderr: what is written to sys.stderr meanwhile (every log line) is
            # printed above the live line.
            self._live = Live(Text(text), console=console, auto_refresh=False, transient=False,
                              redirect_stdout=False, redirect_stderr=True)
            self._live.start()
        self._live.update(Text(text), refresh=True)

    def close(self) -> None:
        """Stop the live line where it is (also when the job fails); nothing is rendered after."""
        self.done = True
        if self._live is not None:
            self._live.stop()
            self._live = None
