"""--worker_pod_priority: which share of the workers is high priority (preempted last)."""

from __future__ import annotations

import math


def parse_priority_spec(spec: str) -> float:
    """``high`` → 1.0, ``low`` → 0.0, or a fraction in [0, 1] of workers that are high."""
    text = spec.strip().lower()
    if text == "high":
        return 1.0
    if text == "low":
        return 0.0
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"--worker_pod_priority must be high, low or a fraction between 0 and 1. Received: {spec!r}"
        )
    return fraction


def high_count(fraction: float, workers: int) -> int:
    return math.ceil(fraction * workers - 1e-9)
