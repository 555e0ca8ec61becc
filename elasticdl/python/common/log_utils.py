"""``from elasticdl.python.common.log_utils import default_logger`` (the original's path):
loggers under ``elasticdl``, formatted and levelled like every role's log."""

import logging


def get_logger(name: str = "elasticdl.model_zoo", level=None, **_ignored) -> logging.Logger:
    """A logger that writes where the role's log goes (the original's extra options are ignored)."""
    logger = logging.getLogger(name if name.startswith("elasticdl") else f"elasticdl.{name}")
    if level is not None:
        logger.setLevel(level)
    return logger


default_logger = get_logger()

__all__ = ["default_logger", "get_logger"]
