"""Logging set-up for every role: one format, the role in each line."""

import logging
import sys

DATE_FORMAT = "%H:%M:%S"


def line_format(role: str) -> str:
    return f"%(asctime)s.%(msecs)03d %(levelname)s [{role}] %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each line, not as it was at set-up: the master's
    live progress line (elasticdl/master/progress.py) swaps in a proxy that prints each log
    line above the progress line instead of gluing it on."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass  # always the current sys.stderr


def configure_logging(level: int | str = logging.INFO, role: str = "client") -> None:
    logging.basicConfig(level=level, handlers=[_StderrHandler()], format=line_format(role), datefmt=DATE_FORMAT,
                        force=True)


def master_log_handler(path: str) -> logging.Handler:
    """The master's log file (runs/<job>/logs/master.log), in the same format as the terminal."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(line_format("master"), DATE_FORMAT))
    return handler
