"""Training progress as the user sees it: epoch, records done / total, loss, examples/s."""

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
        self.records_trained = 0  # every record a worker reported, repeats included
        self.loss_sum = 0.0
        self.batches = 0
        self.recent_loss: float | None = None
        self.model_version = 0
        self._last_line_len = 0
        self.is_tty = self._stream.isatty()

    def record(self, records: int, loss_sum: float, batches: int, model_version: int) -> None:
        with self._lock:
            self.records_trained += records
            self.loss_sum += loss_sum
            self.batches += batches
            if batches:
                self.recent_loss = loss_sum / batches
            self.model_version = max(self.model_version, model_version)

    @property
    def examples_per_second(self) -> float:
        elapsed = time.monotonic() - self._started
        return self.records_trained / elapsed if elapsed > 0 else 0.0

    def line(self, epoch: int, records_done: int) -> str:
        loss = "-" if self.recent_loss is None else f"{self.recent_loss:.4f}"
        total = self.records_per_epoch
        width = 20
        # Clamped: the ledger never counts more than an epoch holds, but the bar must not grow
        # with whatever number it is given.
        filled = min(width, max(0, int(width * records_done / total))) if total else width
        bar = "#" * filled + "." * (width - filled)
        return (
            f"epoch {epoch + 1}/{self.num_epochs} [{bar}] {records_done}/{total} records  "
            f"loss {loss}  {self.examples_per_second:,.0f} examples/s  version {self.model_version}"
        )

    def render(self, epoch: int, records_done: int, final: bool = False) -> None:
        """On a terminal, one line redrawn in place; in a log, a plain line per call."""
        text = self.line(epoch, records_done)
        if self.is_tty:
            pad = " " * max(0, self._last_line_len - len(text))
            self._stream.write("\r" + text + pad + ("\n" if final else ""))
            self._last_line_len = len(text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
