"""Thin alias so ``from elasticdl.python.common.constants import Mode`` keeps working."""

from elasticdl.mode import Mode

__all__ = ["Mode"]
