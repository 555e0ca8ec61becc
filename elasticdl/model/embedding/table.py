"""Embedding tables on a parameter server: rows created on first use, per-row optimizer slots.

Pure numpy (no TensorFlow, no protobuf). A table holds the rows of the ids that hash to
its PS (``id % num_ps``); an id seen for the first time gets a row from the table's
initializer, computed from ``(seed, id, column)`` alone, so a row's initial value does not
depend on which PS creates it, when, or alongside which other ids.

The workers send gradients as ``IndexedRows`` (unique ids, one summed row per id); the PS
gathers those rows and their slots, runs the job's numpy optimizer on the gathered block
and scatters the result back (see ``docs/embeddings.md`` for the lazy semantics this gives
Adam and momentum).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from elasticdl.errors import UserError
from elasticdl.model.optimizers import Optimizer

# What an initializer spec may hold; the layer (elasticdl.layers.Embedding) normalises any
# Keras initializer it supports to one of these before the PS sees it.
DISTRIBUTIONS = ("uniform", "normal", "truncated_normal", "constant")
_INITIAL_CAPACITY = 1024


class EmbeddingError(UserError, ValueError):
    """Bad embedding input (ids, rows, table name); nothing was changed.

    The gRPC edge answers it with INVALID_ARGUMENT.
    """


@dataclass(frozen=True)
class TableInfo:
    """What a PS needs to create an embedding table: its name, row width and initializer."""

    name: str
    dim: int
    initializer: dict = field(default_factory=lambda: {"distribution": "uniform", "minval": -0.05,
                                                       "maxval": 0.05, "seed": 0})

    def __post_init__(self) -> None:
        if not self.name:
            raise EmbeddingError("an embedding table needs a name")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise EmbeddingError(f"embedding table {self.name!r}: dim must be a positive int. Received: {self.dim!r}")
        check_initializer(self.initializer, self.name)

    def to_json(self) -> str:
        return json.dumps(self.initializer, sort_keys=True)

    @classmethod
    def from_json(cls, name: str, dim: int, initializer_json: str) -> TableInfo:
        try:
            initializer = json.loads(initializer_json) if initializer_json else {}
        except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested beyond reason
            raise EmbeddingError(f"embedding table {name!r}: initializer is not JSON: {err}") from None
        return cls(name, int(dim), initializer)


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

_U64 = np.uint64


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wraps modulo 2**64, as intended)."""
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _uniform01(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """[len(ids), dim] float64 in [0, 1): a pure function of (seed, stream, id, column)."""
    key = _mix(np.array([(seed & 0xFFFFFFFF) << 20 | (stream & 0xFFFFF)], dtype=_U64))
    per_id = _mix(ids.astype(_U64) ^ key)
    bits = _mix(per_id[:, None] + np.arange(1, dim + 1, dtype=_U64)[None, :] * _U64(0xD1B54A32D192ED03))
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _standard_normal(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    u1 = _uniform01(seed, ids, dim, 2 * stream)
    u2 = _uniform01(seed, ids, dim, 2 * stream + 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller


def initial_rows(spec: dict, ids: np.ndarray, dim: int) -> np.ndarray:
    """The initial rows of ``ids`` (float32 [n, dim]); the same for an id wherever it is made."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
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


# ---------------------------------------------------------------- rows and gradients


@dataclass
class IndexedRows:
    """Rows of one table: ``ids`` int64 [n] and ``values`` float32 [n, dim].

    Gradients travel this way: unique ids, each with the sum of its rows' gradients.
    """

    ids: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def deduplicated(self) -> IndexedRows:
        """Duplicate ids summed into one row each (ids sorted when there were duplicates)."""
        unique, inverse = np.unique(self.ids, return_inverse=True)
        if unique.size == self.ids.size:
            return self
        summed = np.zeros((unique.size, self.values.shape[1]), np.float32)
        np.add.at(summed, inverse, self.values)
        return IndexedRows(unique, summed)

    def select(self, mask: np.ndarray) -> IndexedRows:
        return IndexedRows(self.ids[mask], self.values[mask])


class RowGradientSum:
    """Sync mode: the row gradients of several pushes, summed per id when the version is applied."""

    def __init__(self) -> None:
        self._parts: list[IndexedRows] = []

    def add(self, rows: IndexedRows, scale: float = 1.0) -> None:
        values = np.asarray(rows.values, np.float32)
        self._parts.append(IndexedRows(rows.ids, values * np.float32(scale) if scale != 1 else values))

    def mean(self, count: int) -> IndexedRows:
        """Summed per id, divided by the number of pushes: the same average dense gradients get."""
        merged = IndexedRows(
            np.concatenate([p.ids for p in self._parts]),
            np.concatenate([p.values for p in self._parts]).astype(np.float32),
        ).deduplicated()  # concatenate made fresh arrays: scaling in place is safe
        merged.values *= np.float32(1.0 / count)
        return merged


def check_ids(table: str, ids: np.ndarray, ps_id: int = 0, num_ps: int = 1) -> None:
    """Raise EmbeddingError unless ``ids`` are 1-D int64, non-negative, and held by this PS."""
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
        dtype = getattr(ids, "dtype", type(ids).__name__)
        raise EmbeddingError(f"ids for embedding table {table!r} must be int64. Received dtype {dtype}")
    if ids.ndim != 1:
        raise EmbeddingError(f"ids for embedding table {table!r} must be 1-D. Received shape {ids.shape}")
    if ids.size and ids.min() < 0:
        raise EmbeddingError(
            f"ids for embedding table {table!r} must be non-negative. Received {int(ids.min())}"
        )
    if num_ps > 1 and ids.size:
        wrong = ids[ids % num_ps != ps_id]
        if wrong.size:
            raise EmbeddingError(
                f"id {int(wrong[0])} of embedding table {table!r} belongs to PS {int(wrong[0] % num_ps)} "
                f"(id % {num_ps}), not to PS {ps_id}"
            )


def check_rows(table: str, rows: IndexedRows, dim: int, ps_id: int = 0, num_ps: int = 1) -> None:
    check_ids(table, rows.ids, ps_id, num_ps)
    values = rows.values
    if not isinstance(values, np.ndarray) or values.dtype.kind != "f":
        raise EmbeddingError(
            f"rows for embedding table {table!r} must be float. Received dtype {getattr(values, 'dtype', None)}"
        )
    if values.shape != (rows.ids.size, dim):
        raise EmbeddingError(
            f"rows for embedding table {table!r} must have shape ({rows.ids.size}, {dim}) "
            f"(one row of width {dim} per id). Received {values.shape}"
        )
    if not np.isfinite(values).all():
        raise EmbeddingError(f"rows for embedding table {table!r} contain NaN or Inf")


# ---------------------------------------------------------------- the table


class EmbeddingTable:
    """The rows (and optimizer slots) of one table that live on this PS.

    Rows sit in one growing float32 block (plus one block per slot); a dict maps an id to
    its row. ``lookup`` copies rows out, ``apply`` gathers rows and slots, runs the
    optimizer on them and scatters them back.
    """

    def __init__(self, info: TableInfo, optimizer: Optimizer | None = None):
        self.info = info
        self.optimizer = optimizer
        self._index: dict[int, int] = {}
        self._size = 0
        self._ids = np.empty(_INITIAL_CAPACITY, np.int64)
        self._rows = np.empty((_INITIAL_CAPACITY, info.dim), np.float32)
        self._slots: dict[str, np.ndarray] = {
            name: np.empty((_INITIAL_CAPACITY, info.dim), np.float32)
            for name in (optimizer.slot_names if optimizer else ())
        }

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dim(self) -> int:
        return self.info.dim

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return (1 + len(self._slots)) * self._size * self.dim * 4 + self._size * 8

    # ------------------------------------------------------------ reads

    def lookup(self, ids: np.ndarray, create: bool) -> np.ndarray:
        """Rows of ``ids`` (a copy). Unknown ids: created when ``create``, else zero rows."""
        positions = self._positions(ids, create)
        if create or ids.size == 0 or positions.min() >= 0:
            return self._rows[positions]
        out = np.zeros((ids.size, self.dim), np.float32)
        known = positions >= 0
        out[known] = self._rows[positions[known]]
        return out

    def state(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(ids, rows, slots): copies of everything this table holds, in creation order."""
        n = self._size
        return self._ids[:n].copy(), self._rows[:n].copy(), {k: v[:n].copy() for k, v in self._slots.items()}

    def frozen(self) -> FrozenTable:
        return FrozenTable(self.info, dict(self._index), self._rows[: self._size].copy())

    # ------------------------------------------------------------ writes

    def apply(self, grads: IndexedRows, step: int, learning_rate: float | None) -> None:
        """One optimizer step on the rows of ``grads`` (unique ids; unknown ids are created first)."""
        if self.optimizer is None:
            raise RuntimeError(f"embedding table {self.name!r} has no optimizer")
        positions = self._positions(grads.ids, create=True)
        rows = self._rows[positions]
        slots = {name: block[positions] for name, block in self._slots.items()}
        self.optimizer.apply(rows, np.asarray(grads.values, np.float32), slots, step, learning_rate)
        self._rows[positions] = rows
        for name, block in self._slots.items():
            block[positions] = slots[name]

    def load(self, ids: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        """Put checkpointed rows (and the slots the optimizer uses) into the table."""
        positions = self._positions(np.asarray(ids, np.int64), create=True)
        self._rows[positions] = rows
        for name, block in self._slots.items():
            if name in slots:
                block[positions] = slots[name]

    def _positions(self, ids: np.ndarray, create: bool) -> np.ndarray:
        keys = ids.tolist()
        get = self._index.get
        positions = np.fromiter((get(k, -1) for k in keys), np.int64, count=len(keys))
        if not create:
            return positions
        missing = positions < 0
        if missing.any():
            new_ids = np.unique(ids[missing])
            start = self._grow(new_ids.size)
            self._ids[start:self._size] = new_ids
            self._rows[start:self._size] = initial_rows(self.info.initializer, new_ids, self.dim)
            if self._slots:
                fresh = self.optimizer.create_slots(self._rows[start:self._size])
                for name, block in self._slots.items():
                    block[start:self._size] = fresh[name]
            self._index.update(zip(new_ids.tolist(), range(start, self._size)))
            positions[missing] = [self._index[k] for k in ids[missing].tolist()]
        return positions

    def _grow(self, extra: int) -> int:
        start = self._size
        needed = start + extra
        if needed > self._ids.shape[0]:
            capacity = max(needed, 2 * self._ids.shape[0])
            self._ids = _resized(self._ids, capacity)
            self._rows = _resized(self._rows, capacity)
            self._slots = {k: _resized(v, capacity) for k, v in self._slots.items()}
        self._size = needed
        return start


@dataclass
class FrozenTable:
    """A read-only copy of a table (evaluation snapshots): unknown ids read as zero rows."""

    info: TableInfo
    index: dict[int, int]
    rows: np.ndarray

    def lookup(self, ids: np.ndarray, create: bool = False) -> np.ndarray:
        get = self.index.get
        positions = np.fromiter((get(k, -1) for k in ids.tolist()), np.int64, count=ids.size)
        out = np.zeros((ids.size, self.info.dim), np.float32)
        known = positions >= 0
        out[known] = self.rows[positions[known]]
        return out


def _resized(array: np.ndarray, capacity: int) -> np.ndarray:
    out = np.empty((capacity, *array.shape[1:]), array.dtype)
    out[: array.shape[0]] = array
    return out
