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


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    clock = FakeClock()
    progress = TrainingProgress(100, 2, stream=terminal, clock=clock)
    clock.now += 1
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
    assert lines[-1].endswith("loss 0.5  50 examples/s (avg 50)  version 7"), lines
    assert sys.stderr is terminal  # the live display gave stderr back


def test_off_a_terminal_plain_lines_and_the_last_one_once():
    log = io.StringIO()
    progress = TrainingProgress(100, 1, stream=log)
    progress.render(0, 40)
    progress.render(0, 100, final=True)
    progress.render(0, 100, final=True)
    assert log.getvalue().splitlines() == [
        "epoch 1/1 [####......] 40/100  loss -  0 examples/s (avg 0)  version 0",
        "epoch 1/1 [##########] 100/100  loss -  0 examples/s (avg 0)  version 0",
    ]


def test_the_current_rate_follows_the_last_ten_seconds_and_the_average_the_whole_job():
    clock = FakeClock()
    progress = TrainingProgress(10**6, 1, stream=io.StringIO(), clock=clock)
    for _ in range(30):  # 30 s at 100 records/s: one worker
        clock.now += 1
        progress.record(100, 1.0, 1, 1)
    assert progress.current_rate == pytest.approx(100)
    for _ in range(10):  # `elasticdl scale` doubled the workers: 10 s at 200 records/s
        clock.now += 1
        progress.record(200, 1.0, 1, 1)
    assert progress.current_rate == pytest.approx(200)  # the window holds only the new rate
    assert progress.examples_per_second == pytest.approx(5000 / 40)  # the average moves slowly
    assert "200 examples/s (avg 125)" in progress.line(0, 0)
    clock.now += 5  # every worker stopped: half the window is empty
    assert progress.current_rate == pytest.approx(100)
    clock.now += 10
    assert progress.current_rate == 0.0
    assert progress.examples_per_second == pytest.approx(125)  # to the last report, not to now


def test_the_current_rate_of_a_job_younger_than_the_window_is_over_its_age():
    clock = FakeClock()
    progress = TrainingProgress(10**6, 1, stream=io.StringIO(), clock=clock)
    assert progress.current_rate == 0.0
    clock.now += 2
    progress.record(300, 1.0, 1, 1)
    assert progress.current_rate == pytest.approx(150)


@pytest.mark.parametrize("loss, shown", [
    (1e-5, "1e-05"), (0.0662, "0.0662"), (0.000123456, "0.0001235"), (2.302585, "2.303"), (12345.6, "1.235e+04"),
])
def test_the_loss_is_shown_in_significant_digits(loss, shown):
    progress = TrainingProgress(100, 1, stream=io.StringIO())
    progress.record(10, loss * 4, 4, 1)
    assert f"loss {shown}  " in progress.line(0, 10)
