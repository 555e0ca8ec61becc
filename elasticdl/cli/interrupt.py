"""Ctrl-C on ``elasticdl train|evaluate|predict``: acknowledged at once, and the way to continue.

The first Ctrl-C prints ``stopping: ...`` at once, naming the last complete checkpoint, then
raises KeyboardInterrupt as Python's own handler would: the job stops its roles (within 2 s,
elasticdl/master/job_end.py) and writes its report. A second Ctrl-C stops the command at
once (the local roles die with it: elasticdl/launch/child.py), without a report.

The last line then names the checkpoint and the command that continues from it, from the
report the job wrote (``checkpoint``, ``continue_command``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from elasticdl.errors import EXIT_INTERRUPTED
from elasticdl.master.continuation import last_complete_checkpoint


class CtrlC:
    """The SIGINT handler around a job (a context manager; only in the main thread, where
    Python runs signal handlers). ``checkpoint_dir``: the job's ``--checkpoint_dir``;
    ``enabled=False``: Python's own handler stays."""

    def __init__(self, program: str, checkpoint_dir: str = "", enabled: bool = True):
        self.program = program
        self.checkpoint_dir = checkpoint_dir
        self.enabled = enabled
        self.pressed_at: float | None = None
        self._previous = None

    def __enter__(self) -> CtrlC:
        # A command started with SIGINT ignored (nohup, a background job of a shell) keeps it so.
        if self.enabled and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.pressed_at is not None:
            print(f"\n{self.program}: stopping at once (Ctrl-C again)", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
            return  # (os._exit does not return; a test's stand-in does)
        self.pressed_at = time.time()
        print(f"\n{self.program}: {self.stopping_message()}", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    def stopping_message(self) -> str:
        checkpoint = last_complete_checkpoint(self.checkpoint_dir)
        where = f"; the last complete checkpoint is {checkpoint}" if checkpoint else ""
        return f"stopping: finishing the report and stopping every process (Ctrl-C again: at once){where}"


def continuation(report_file: str, since: float) -> str:
    """The lines that say how to continue, from an interrupted job's report written after
    ``since`` (a time.time()); '' when there is none (interrupted before the job started)."""
    try:
        if os.path.getmtime(report_file) < since:
            return ""  # an earlier run's
        with open(report_file, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return ""
    if report.get("status") != "interrupted" or not report.get("checkpoint"):
        return ""
    lines = f"the last complete checkpoint is {report['checkpoint']}"
    if report.get("continue_command"):
        lines += f"; to continue from it:\n  {report['continue_command']}"
    return lines
