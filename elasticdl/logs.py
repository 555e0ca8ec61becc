"""Logging set-up for every role: one format, the role in each line."""

import logging
import sys


def configure_logging(level: int | str = logging.INFO, role: str = "client") -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s.%(msecs)03d %(levelname)s [{role}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
