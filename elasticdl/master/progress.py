"""Training progress as the user sees it: epoch, records done / total, loss, examples/s.

On a terminal the progress is one live line at the bottom (``rich.live.Live``); log lines
print above it, never glued onto it (the console log handler writes to the current
``sys.stderr``, which the live display proxies). Elsewhere (a file, a pipe) it is a plain
line each time it is rendered. Either way, once training is done the last line is written
once and never again.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class TrainingProgress:
    """Fed by task reports (any thread); rendered by the job loop."""

    def __init__(self, records_per_epoch: int, num_epochs: int, stream: TextIO | None = None):
        self.records_per_epoch = records_per_epoch
        self.num_epochs = num_epochs
        self._stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._last_record = self._started  # examples/s counts to the last report, not to now
        self.records_trained = 0  # every record a worker reported, repeats included
        self.loss_sum = 0.0
        self.batches = 0
        self.recent_loss: float | None = None
        self.model_version = 0
        self.is_tty = self._stream.isatty()
        self._live = None  # the rich Live display, on a terminal, while training runs
        self.done = False  # the final line was written: nothing is rendered after it

    def record(self, records: int, loss_sum: float, batches: int, model_version: int) -> None:
        with self._lock:
            self.records_trained += records
            self.loss_sum += loss_sum
            self.batches += batches
            if batches:
                self.recent_loss = loss_sum / batches
            self.model_version = max(self.model_version, model_version)
            if records:
                self._last_record = time.monotonic()

    @property
    def examples_per_second(self) -> float:
        """Records trained per second, from the master's start to the last task report (so the
        figure does not sink while the job waits for evaluation or for workers to leave)."""
        elapsed = self._last_record - self._started
        return self.records_trained / elapsed if elapsed > 0 else 0.0

    def line(self, epoch: int, records_done: int) -> str:
        loss = "-" if self.recent_loss is None else f"{self.recent_loss:.4f}"
        total = self.records_per_epoch
        width = 10  # the whole line fits in 80 columns
        # Clamped: the ledger never counts more than an epoch holds, but the bar must not grow
        # with whatever number it is given.
        filled = min(width, max(0, int(width * records_done / total))) if total else width
        bar = "#" * filled + "." * (width - filled)
        return (
            f"epoch {epoch + 1}/{self.num_epochs} [{bar}] {records_done}/{total}  "
            f"loss {loss}  {self.examples_per_second:,.0f} examples/s  version {self.model_version}"
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
