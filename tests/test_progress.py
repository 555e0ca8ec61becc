"""The progress line beside the log: never glued onto a log line, nothing after training ends."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from elasticdl.logs import configure_logging
from elasticdl.master.progress import TrainingProgress

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def screen_lines(text: str) -> list[str]:
    """What each terminal line ends up showing: after a carriage return a line is redrawn."""
    return [part.split("\r")[-1] for part in _ANSI.sub("", text).split("\n")]


def test_on_a_terminal_log_lines_print_above_the_live_line(monkeypatch, root_logging):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    configure_logging("INFO", "master")
    progress = TrainingProgress(100, 2, stream=terminal)
    progress.record(50, 1.0, 2, 7)
    progress.render(0, 50)
    logging.getLogger("elasticdl.master.task_manager").info("epoch 2 of 2 starts")
    progress.render(1, 60)
    progress.render(1, 100, final=True)
    progress.render(1, 100)  # training ended: nothing is drawn any more
    lines = [line for line in screen_lines(terminal.getvalue()) if line.strip()]
    log_lines = [line for line in lines if "INFO" in line]
    assert len(log_lines) == 1 and re.match(r"\d\d:\d\d:\d\d\.\d{3} INFO \[master\]", log_lines[0]), lines
    assert lines[-1].startswith("epoch 2/2 [##########] 100/100"), lines
    assert "examples/s  version 7" in lines[-1]
    assert sys.stderr is terminal  # the live display gave stderr back


def test_off_a_terminal_plain_lines_and_the_last_one_once():
    log = io.StringIO()
    progress = TrainingProgress(100, 1, stream=log)
    progress.render(0, 40)
    progress.render(0, 100, final=True)
    progress.render(0, 100, final=True)
    assert log.getvalue().splitlines() == [
        "epoch 1/1 [####......] 40/100  loss -  0 examples/s  version 0",
        "epoch 1/1 [##########] 100/100  loss -  0 examples/s  version 0",
    ]
