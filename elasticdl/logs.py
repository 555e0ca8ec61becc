"""Logging set-up for every role: one format, the role in each line."""

import logging
import sys

DATE_FORMAT = "%H:%M:%S"


def line_format(role: str) -> str:
    return f"%(asctime)s.%(msecs)03d %(levelname)s [{role}] %(name)s: %(message)s"


def configure_logging(level: int | str = logging.INFO, role: str = "client") -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format=line_format(role), datefmt=DATE_FORMAT, force=True)


def master_log_handler(path: str) -> logging.Handler:
    """The master's log file (runs/<job>/logs/master.log), in the same format as the terminal."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(line_format("master"), DATE_FORMAT))
    return handler
