"""How a new embedding row starts: a pure function of (seed, id, column), checked specs.

A row's initial value does not depend on which PS creates it, when, or alongside which other
ids: re-sharding, restarts and replicas all agree on it (docs/embeddings.md).
"""

from __future__ import annotations

import math

import numpy as np

from elasticdl.model.embedding.errors import EmbeddingError
from elasticdl.model.embedding.hashing import U64, keyed, mix64

# What an initializer spec may hold; the layer (elasticdl.layers.Embedding) normalises any
# Keras initializer it supports to one of these before the PS sees it.
DISTRIBUTIONS = ("uniform", "normal", "truncated_normal", "constant")


def check_initializer(spec: dict, table: str = "") -> None:
    where = f"embedding table {table!r}: " if table else ""
    if not isinstance(spec, dict) or spec.get("distribution") not in DISTRIBUTIONS:
        raise EmbeddingError(
            f"{where}initializer must be a dict with 'distribution' in {', '.join(DISTRIBUTIONS)}. "
            f"Received: {spec!r}"
        )
    needed = {
        "uniform": ("minval", "maxval"),
        "normal": ("mean", "stddev"),
        "truncated_normal": ("mean", "stddev"),
        "constant": ("value",),
    }[spec["distribution"]]
    for key in (*needed, "seed"):
        value = spec.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise EmbeddingError(f"{where}initializer {spec['distribution']} needs a number {key!r}. Received: {spec!r}")


# ---------------------------------------------------------------- deterministic initial rows

def _uniform01(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """[len(ids), dim] float64 in [0, 1): a pure function of (seed, stream, id, column)."""
    per_id = mix64(ids.astype(U64) ^ keyed(seed, stream))
    bits = per_id[:, None] + np.arange(1, dim + 1, dtype=U64)[None, :] * U64(0xD1B54A32D192ED03)
    # mix64 (hashing.py) in place: the block is a batch's ids x the width, its temporaries the cost.
    bits += U64(0x9E3779B97F4A7C15)
    shifted = bits >> U64(30)
    bits ^= shifted
    bits *= U64(0xBF58476D1CE4E5B9)
    np.right_shift(bits, U64(27), out=shifted)
    bits ^= shifted
    bits *= U64(0x94D049BB133111EB)
    np.right_shift(bits, U64(31), out=shifted)
    bits ^= shifted
    np.right_shift(bits, U64(11), out=bits)  # unit_interval: the top 53 bits
    return bits.astype(np.float64) * (1.0 / (1 << 53))


def _standard_normal(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    u1 = _uniform01(seed, ids, dim, 2 * stream)
    u2 = _uniform01(seed, ids, dim, 2 * stream + 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller


# Values computed per pass: the hash's uint64 temporaries (a few arrays of 8 bytes per value)
# stay bounded when a batch is large (a checkpoint's rows put back at once), since a PS keeps
# freed heap memory for good (launch/api.py's ROLE_ENV); a batch of 8,192 ids x 16 is one pass.
# Each value is a function of its id and column alone, so chunks change nothing.
CHUNK_VALUES = 1 << 17


def initial_rows(spec: dict, ids: np.ndarray, dim: int, out: np.ndarray | None = None) -> np.ndarray:
    """The initial rows of ``ids`` (float32 [n, dim]); the same for an id wherever it is made.
    ``out``: float32 [n, dim] to write them into (a view of the table's new rows)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((ids.size, dim), np.float32) if out is None else out
    step = max(1, CHUNK_VALUES // dim)
    for start in range(0, ids.size, step):
        out[start:start + step] = _initial_rows(spec, ids[start:start + step], dim)
    return out


def _initial_rows(spec: dict, ids: np.ndarray, dim: int) -> np.ndarray:
    kind, seed = spec["distribution"], int(spec.get("seed", 0))
    if kind == "constant":
        return np.full((ids.size, dim), spec["value"], np.float32)
    if kind == "uniform":
        lo, hi = float(spec["minval"]), float(spec["maxval"])
        return (lo + (hi - lo) * _uniform01(seed, ids, dim, 0)).astype(np.float32)
    z = _standard_normal(seed, ids, dim, 0)
    if kind == "truncated_normal":
        # Keras's TruncatedNormal redraws values beyond two standard deviations; each
        # element redraws from its own next stream, so it stays a function of (id, column).
        stream = 1
        outside = np.abs(z) > 2.0
        while outside.any():
            z = np.where(outside, _standard_normal(seed, ids, dim, stream), z)
            outside = np.abs(z) > 2.0
            stream += 1
    return (float(spec["mean"]) + float(spec["stddev"]) * z).astype(np.float32)
