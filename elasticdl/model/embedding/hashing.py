"""Counter-based hashing (splitmix64) for embedding tables: a pure function of its input.

Initial rows, admission draws and the admission sketch all hash ``(seed, id, ...)`` this way,
so every PS and every replica computes the same value for an id, in any order.
"""

from __future__ import annotations

import numpy as np

U64 = np.uint64


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wraps modulo 2**64, as intended)."""
    z = z + U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def keyed(seed: int, stream: int) -> np.uint64:
    """The hash key of one stream of a table's seed."""
    return mix64(np.array([(seed & 0xFFFFFFFF) << 20 | (stream & 0xFFFFF)], dtype=U64))[0]


def unit_interval(bits: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 in [0, 1) (the top 53 bits)."""
    return (bits >> U64(11)).astype(np.float64) * (1.0 / (1 << 53))
