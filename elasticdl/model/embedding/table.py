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

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from elasticdl.model.embedding.admission import AdmissionFilter
from elasticdl.model.embedding.errors import EmbeddingError
from elasticdl.model.embedding.eviction import RecencyLog
from elasticdl.model.embedding.hashing import U64, keyed, mix64, unit_interval
from elasticdl.model.embedding.policy import PolicyError, TableCounters, TablePolicy, TableStats
from elasticdl.model.embedding.rows import IndexedRows, RowGradientSum, check_ids, check_rows
from elasticdl.model.optimizers import Optimizer

# Re-exported: the PS, the worker and the tests import them from here.
__all__ = ["EmbeddingError", "EmbeddingTable", "FrozenTable", "IndexedRows", "RowGradientSum", "TableInfo",
           "check_ids", "check_rows", "initial_rows"]

# What an initializer spec may hold; the layer (elasticdl.layers.Embedding) normalises any
# Keras initializer it supports to one of these before the PS sees it.
DISTRIBUTIONS = ("uniform", "normal", "truncated_normal", "constant")
_INITIAL_CAPACITY = 1024


@dataclass(frozen=True)
class TableInfo:
    """What a PS needs to create an embedding table: its name, row width and initializer."""

    name: str
    dim: int
    initializer: dict = field(default_factory=lambda: {"distribution": "uniform", "minval": -0.05,
                                                       "maxval": 0.05, "seed": 0})
    policy: TablePolicy = TablePolicy()  # admission and eviction (model/embedding/policy.py)

    def __post_init__(self) -> None:
        if not self.name:
            raise EmbeddingError("an embedding table needs a name")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise EmbeddingError(f"embedding table {self.name!r}: dim must be a positive int. Received: {self.dim!r}")
        check_initializer(self.initializer, self.name)
        if not isinstance(self.policy, TablePolicy):
            raise EmbeddingError(f"embedding table {self.name!r}: policy must be a TablePolicy. Received: {self.policy!r}")

    def to_json(self) -> str:
        """The initializer as JSON, with the policy under "policy" when it bounds anything (the
        wire's initializer field, so a PS that predates policies reads the same initializer)."""
        policy = self.policy.to_dict()
        return json.dumps({**self.initializer, "policy": policy} if policy else self.initializer, sort_keys=True)

    @classmethod
    def from_json(cls, name: str, dim: int, initializer_json: str) -> TableInfo:
        try:
            initializer = json.loads(initializer_json) if initializer_json else {}
        except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested beyond reason
            raise EmbeddingError(f"embedding table {name!r}: initializer is not JSON: {err}") from None
        if not isinstance(initializer, dict):
            raise EmbeddingError(f"embedding table {name!r}: initializer must be a JSON object. Received: {initializer!r}")
        try:
            policy = TablePolicy.from_dict(initializer.pop("policy", None), name)
        except PolicyError as err:
            raise EmbeddingError(str(err)) from None
        return cls(name, int(dim), initializer, policy)


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
    bits = mix64(per_id[:, None] + np.arange(1, dim + 1, dtype=U64)[None, :] * U64(0xD1B54A32D192ED03))
    return unit_interval(bits)


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


# ---------------------------------------------------------------- the table


# How many log entries one advance() looks at for expired rows: a bound on the work a version
# adds to a push; rows it did not reach are expired at the next versions, or when looked up.
EXPIRE_BUDGET = 1 << 16


class EmbeddingTable:
    """The rows (and optimizer slots) of one table that live on this PS.

    Rows sit in one growing float32 block (plus one block per slot); a dict maps an id to
    its row. ``lookup`` copies rows out, ``apply`` gathers rows and slots, runs the
    optimizer on them and scatters them back. Under a bounding ``info.policy``, new ids pass
    an admission filter and rows are evicted by age and by the row cap; an evicted row's place
    is reused by the next new row (docs/embeddings.md, "Bounded tables").
    """

    def __init__(self, info: TableInfo, optimizer: Optimizer | None = None):
        self.info = info
        self.optimizer = optimizer
        self.version = 0  # the shard's model version, as of the last advance()
        self.counters = TableCounters()
        self._index: dict[int, int] = {}
        self._size = 0  # positions in use, evicted ones included
        self._live = 0
        # Positions of evicted rows, reused first: a stack of the evicted batches (appending one
        # costs its own size, not the size of all that wait).
        self._free: list[np.ndarray] = []
        self._ids = np.empty(_INITIAL_CAPACITY, np.int64)  # -1 at an evicted row
        self._touched = np.empty(_INITIAL_CAPACITY, np.int64)  # version of each row's last update
        self._rows = np.empty((_INITIAL_CAPACITY, info.dim), np.float32)
        self._slots: dict[str, np.ndarray] = {
            name: np.empty((_INITIAL_CAPACITY, info.dim), np.float32)
            for name in (optimizer.slot_names if optimizer else ())
        }
        self._admission: AdmissionFilter | None = None
        self._log: RecencyLog | None = None
        self.set_policy(info.policy)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dim(self) -> int:
        return self.info.dim

    @property
    def policy(self) -> TablePolicy:
        return self.info.policy

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return (1 + len(self._slots)) * self._live * self.dim * 4 + self._live * 16  # + id, last-update version

    def stats(self) -> TableStats:
        return TableStats(self.name, self._live, self.nbytes, dataclasses.replace(self.counters))

    def set_policy(self, policy: TablePolicy, sketch: dict[str, np.ndarray] | None = None) -> None:
        """Bound the table by ``policy`` from now on (a job resumed with other settings)."""
        self.info = dataclasses.replace(self.info, policy=policy)
        seed = int(self.info.initializer.get("seed", 0))
        if sketch is None and self._admission is not None:
            sketch = self._admission.saved()  # sightings counted so far stay counted
        self._admission = AdmissionFilter(policy, seed, sketch) if policy.filters_admission else None
        if not policy.evicts:
            self._log = None
        elif self._log is None:
            self._log = RecencyLog()
            live = self._live_positions()
            self._log_touch(live[np.argsort(self._touched[live], kind="stable")])
        self._enforce_cap()

    # ------------------------------------------------------------ reads

    def lookup(self, ids: np.ndarray, create: bool) -> np.ndarray:
        """Rows of ``ids`` (a copy). Unknown ids: created when ``create`` (and admission does
        not filter new ids), else zero rows."""
        positions = self._positions(ids, create and self._admission is None)
        if ids.size == 0 or positions.min() >= 0:
            out = self._rows[positions]
        else:
            out = np.zeros((ids.size, self.dim), np.float32)
            known = positions >= 0
            out[known] = self._rows[positions[known]]
        self._enforce_cap()
        return out

    def state(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(ids, rows, slots): copies of the live rows, in creation order (least recently
        updated first when the table evicts)."""
        order = self._saved_order()
        return self._ids[order], self._rows[order], {k: v[order] for k, v in self._slots.items()}

    def saved(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
        """``state()`` plus what resuming a bounded table needs: each row's last-update version,
        and the table's counters and admission sketch."""
        order = self._saved_order()
        meta: dict[str, np.ndarray] = {}
        if self.policy.bounded:
            meta["counters"] = np.array(self.counters.as_list(), np.int64)
        if self._admission is not None and self._admission.sketch is not None:
            meta.update(self._admission.saved())
        ids, rows, slots = self._ids[order], self._rows[order], {k: v[order] for k, v in self._slots.items()}
        return ids, rows, slots, self._touched[order], meta

    def frozen(self) -> FrozenTable:
        return FrozenTable(self.info, dict(self._index), self._rows[: self._size].copy())

    # ------------------------------------------------------------ writes

    def apply(self, grads: IndexedRows, step: int, learning_rate: float | None, version: int | None = None) -> None:
        """One optimizer step on the rows of ``grads`` (unique ids), the update that makes model
        ``version`` (default: the next). Unknown ids are created first, or, when admission
        filters, only those it admits: the others' gradient rows are dropped (and counted)."""
        if self.optimizer is None:
            raise RuntimeError(f"embedding table {self.name!r} has no optimizer")
        version = self.version + 1 if version is None else version
        ids, values = grads.ids, np.asarray(grads.values, np.float32)
        # New rows are logged below with this update, not also at their creation.
        positions = self._positions(ids, create=self._admission is None, fresh_touch=False)
        if self._admission is not None:
            missing = np.flatnonzero(positions < 0)
            if missing.size:
                admitted = self._admission.admit(ids[missing], step)
                chosen = missing[admitted]
                if chosen.size:
                    positions[chosen] = self._create(ids[chosen], log=False)
                self.counters.dropped_gradients += int(missing.size - chosen.size)
                if chosen.size < missing.size:
                    keep = positions >= 0
                    ids, values, positions = ids[keep], values[keep], positions[keep]
        rows = self._rows[positions]
        slots = {name: block[positions] for name, block in self._slots.items()}
        self.optimizer.apply(rows, values, slots, step, learning_rate)
        self._rows[positions] = rows
        for name, block in self._slots.items():
            block[positions] = slots[name]
        self._touched[positions] = version
        self._log_touch(positions)
        self._enforce_cap()

    def advance(self, version: int) -> None:
        """The shard reached model ``version``: rows older than ``ttl_versions`` are expired
        (those at the log's front, up to EXPIRE_BUDGET entries per call)."""
        self.version = version
        if self._log is not None and self.policy.ttl_versions:
            popped = self._log.pop(self._ids, self._touched, older_than=version - self.policy.ttl_versions,
                                   budget=EXPIRE_BUDGET)
            self._evict(popped.positions, ttl=True)

    def load(self, ids: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray],
             touched: np.ndarray | None = None, meta: dict[str, np.ndarray] | None = None, version: int = 0) -> None:
        """Put checkpointed rows (and the slots the optimizer uses) into the table; with
        ``touched`` and ``meta`` (saved()), the bounded table resumes where it was."""
        self.version = max(self.version, version)
        ids = np.asarray(ids, np.int64)
        order = np.arange(ids.size) if touched is None else np.argsort(touched, kind="stable")
        admissions = self.counters.admissions  # rows coming back are not admitted anew
        positions = self._positions(ids[order], create=True, fresh_touch=False)
        self.counters.admissions = admissions
        self._rows[positions] = rows[order]
        for name, block in self._slots.items():
            if name in slots:
                block[positions] = slots[name][order]
        self._touched[positions] = self.version if touched is None else touched[order]
        self._log_touch(positions)
        meta = meta or {}
        if "counters" in meta:
            self.counters = TableCounters.from_list(meta["counters"])
        if "sketch" in meta:
            self.set_policy(self.policy, meta)
        self._enforce_cap()

    # ------------------------------------------------------------ positions

    def _positions(self, ids: np.ndarray, create: bool, fresh_touch: bool = True) -> np.ndarray:
        keys = ids.tolist()
        get = self._index.get
        positions = np.fromiter((get(k, -1) for k in keys), np.int64, count=len(keys))
        ttl = self.policy.ttl_versions
        if ttl and positions.size:
            # Lazily: a row advance() has not reached yet is expired when it is read.
            expired = (positions >= 0) & (self._touched[np.maximum(positions, 0)] <= self.version - ttl)
            if expired.any():
                self._evict(np.unique(positions[expired]), ttl=True)
                positions[expired] = -1
        if not create:
            return positions
        missing = positions < 0
        if missing.any():
            new_ids = np.unique(ids[missing])
            self._create(new_ids, log=fresh_touch)
            positions[missing] = [self._index[k] for k in ids[missing].tolist()]
        return positions

    def _create(self, new_ids: np.ndarray, log: bool = True) -> np.ndarray:
        """Rows for ``new_ids`` (unique, not held), at their initial values; their positions."""
        reused = self._reuse(new_ids.size)
        start = self._grow(new_ids.size - reused.size)
        positions = np.concatenate([reused, np.arange(start, self._size, dtype=np.int64)])
        self._ids[positions] = new_ids
        self._rows[positions] = initial_rows(self.info.initializer, new_ids, self.dim)
        if self._slots:
            fresh = self.optimizer.create_slots(self._rows[positions])
            for name, block in self._slots.items():
                block[positions] = fresh[name]
        self._index.update(zip(new_ids.tolist(), positions.tolist()))
        self._live += new_ids.size
        self.counters.admissions += int(new_ids.size)
        self._touched[positions] = self.version
        if log:
            self._log_touch(positions)
        return positions

    def _reuse(self, count: int) -> np.ndarray:
        taken = []
        while count and self._free:
            chunk = self._free[-1]
            if chunk.size <= count:
                taken.append(self._free.pop())
                count -= chunk.size
            else:
                taken.append(chunk[chunk.size - count:])
                self._free[-1] = chunk[: chunk.size - count]
                count = 0
        return np.concatenate(taken) if taken else np.empty(0, np.int64)

    def _log_touch(self, positions: np.ndarray) -> None:
        if self._log is not None and positions.size:
            self._log.append(positions, self._ids[positions], self._touched[positions], self._live,
                             self._ids, self._touched)

    def _enforce_cap(self) -> None:
        """Evict the least recently updated rows while the table holds more than max_rows."""
        cap = self.policy.max_rows
        if cap and self._live > cap and self._log is not None:
            self._evict(self._log.pop(self._ids, self._touched, count=self._live - cap).positions, ttl=False)

    def _evict(self, positions: np.ndarray, ttl: bool) -> None:
        if not positions.size:
            return
        index = self._index
        for key in self._ids[positions].tolist():
            del index[key]
        self._ids[positions] = -1
        self._free.append(positions)
        self._live -= positions.size
        if ttl:
            self.counters.evictions_ttl += int(positions.size)
        else:
            self.counters.evictions_max_rows += int(positions.size)

    def _live_positions(self) -> np.ndarray:
        return np.flatnonzero(self._ids[: self._size] >= 0)

    def _saved_order(self) -> np.ndarray:
        if self._log is not None:
            return self._log.live_order(self._ids, self._touched)
        return self._live_positions()

    def _grow(self, extra: int) -> int:
        start = self._size
        needed = start + extra
        if needed > self._ids.shape[0]:
            capacity = max(needed, 2 * self._ids.shape[0])
            self._ids = _resized(self._ids, capacity)
            self._touched = _resized(self._touched, capacity)
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
