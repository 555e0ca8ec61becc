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
from dataclasses import dataclass, field

import numpy as np

from elasticdl.model.embedding.admission import AdmissionFilter
from elasticdl.model.embedding.blocks import by_part, by_row
from elasticdl.model.embedding.errors import EmbeddingError
from elasticdl.model.embedding.eviction import RecencyLog
from elasticdl.model.embedding.id_index import IdIndex
from elasticdl.model.embedding.initializers import DISTRIBUTIONS, check_initializer, initial_rows
from elasticdl.model.embedding.memory import MappedArray
from elasticdl.model.embedding.policy import PolicyError, TableCounters, TablePolicy, TableStats
from elasticdl.model.embedding.recent import RecentPositions
from elasticdl.model.embedding.rows import (
    IndexedRows,
    RowGradientSum,
    check_ids,
    check_rows,
    id_runs,
    summed_runs,
)
from elasticdl.model.optimizers import Optimizer

# Re-exported: the PS, the worker and the tests import them from here.
__all__ = ["DISTRIBUTIONS", "EmbeddingError", "EmbeddingTable", "FrozenTable", "IndexedRows", "RowGradientSum",
           "TableInfo", "check_ids", "check_initializer", "check_rows", "initial_rows"]

_INITIAL_CAPACITY = 1024
# Rows (with their slots) up to this size are read whole even when only the row is wanted (a
# lookup): random reads cost their latency, not their bytes (8,192 rows of 192 bytes from a
# million: 247 us whole, 266 us for the first 64 bytes), and the slots are then in cache for
# the update that follows a lookup (its gather: 180 instead of 250 us).
_WHOLE_ROW_BYTES = 256


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


# ---------------------------------------------------------------- the table


# How many log entries one advance() looks at for expired rows: a bound on the work a version
# adds to a push; rows it did not reach are expired at the next versions, or when looked up.
EXPIRE_BUDGET = 1 << 16


class EmbeddingTable:
    """The rows (and optimizer slots) of one table that live on this PS.

    Each row sits at a position of one growing float32 block, followed by its optimizer slots
    (``[capacity, dim x (1 + slots)]``), so an update gathers and scatters each row once; an
    ``IdIndex`` (a NumPy hash) maps ids to positions, a batch at a time. ``lookup`` copies rows
    out, ``apply`` gathers rows and slots, runs the optimizer on them and scatters them back.
    Under a bounding ``info.policy``, new ids pass an admission filter and rows are evicted by
    age and by the row cap; an evicted row's place is reused by the next new row
    (docs/embeddings.md, "Bounded tables" and "The table").
    """

    def __init__(self, info: TableInfo, optimizer: Optimizer | None = None):
        self.info = info
        self.optimizer = optimizer
        self.version = 0  # the shard's model version, as of the last advance()
        self.counters = TableCounters()
        self._slot_names: tuple[str, ...] = tuple(optimizer.slot_names) if optimizer else ()
        dim = info.dim
        # Columns of each slot in the block, and the value a new row's slots start from (an
        # optimizer's slots start from a constant: one template row serves every new row).
        self._slot_columns = {name: slice(dim * (i + 1), dim * (i + 2)) for i, name in enumerate(self._slot_names)}
        fresh = optimizer.create_slots(np.zeros((1, dim), np.float32)) if self._slot_names else {}
        self._fresh_slots = (np.concatenate([fresh[name] for name in self._slot_names], axis=1)
                             if fresh else np.zeros((1, 0), np.float32))
        self._index = IdIndex(_INITIAL_CAPACITY)
        self._recent = RecentPositions()
        self._size = 0  # positions in use, evicted ones included
        # Positions of evicted rows, reused first: a stack of the evicted batches (appending one
        # costs its own size, not the size of all that wait).
        self._free: list[np.ndarray] = []
        self._free_count = 0
        # Each in its own mapping, grown in place (model/embedding/memory.py).
        self._touched_map = MappedArray(_INITIAL_CAPACITY, (), np.int64)
        self._touched = self._touched_map.array()  # version of each row's last update
        self._rows_map = MappedArray(_INITIAL_CAPACITY, (dim * (1 + len(self._slot_names)),), np.float32)
        self._rows = self._rows_map.array()
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
        return len(self._index)

    @property
    def _ids(self) -> np.ndarray:
        return self._index.ids  # -1 at a free position

    @property
    def nbytes(self) -> int:
        """The live rows (row, slots, id, last-update version) and the id index."""
        return len(self) * (self._rows.shape[1] * 4 + 16) + self._index.nbytes

    def stats(self) -> TableStats:
        return TableStats(self.name, len(self), self.nbytes, dataclasses.replace(self.counters))

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
            live = self._index.live_positions()
            self._log_touch(live[np.argsort(self._touched[live], kind="stable")])
        self._enforce_cap()

    # ------------------------------------------------------------ reads

    def lookup(self, ids: np.ndarray, create: bool) -> np.ndarray:
        """Rows of ``ids`` (a copy). Unknown ids: created when ``create`` (and admission does
        not filter new ids), else zero rows."""
        positions = self._positions(ids, create and self._admission is None)
        if ids.size == 0 or positions.min() >= 0:
            out = self._gather(positions, self.dim)
            self._recent.remember(ids, positions)  # for the push of these ids that follows
        else:
            out = np.zeros((ids.size, self.dim), np.float32)
            known = positions >= 0
            out[known] = self._gather(positions[known], self.dim)
        self._enforce_cap()
        return out

    def state(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(ids, rows, slots): copies of the live rows, in creation order (least recently
        updated first when the table evicts)."""
        ids, rows, slots, _, _ = self.saved()
        return ids, rows, slots

    def saved(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
        """``state()`` plus what resuming a bounded table needs: each row's last-update version,
        and the table's counters and admission sketch."""
        order = self._saved_order()
        meta: dict[str, np.ndarray] = {}
        if self.policy.bounded:
            meta["counters"] = np.array(self.counters.as_list(), np.int64)
        if self._admission is not None and self._admission.sketch is not None:
            meta.update(self._admission.saved())
        block = self._gather(order, self._rows.shape[1])
        slots = {name: np.ascontiguousarray(block[:, cols]) for name, cols in self._slot_columns.items()}
        return self._ids[order], np.ascontiguousarray(block[:, : self.dim]), slots, self._touched[order], meta

    def frozen(self) -> FrozenTable:
        return FrozenTable(self.info, self._index.copy(), self._rows[: self._size, : self.dim].copy())

    # ------------------------------------------------------------ writes

    def apply(self, grads: IndexedRows, step: int, learning_rate: float | None, version: int | None = None) -> None:
        """One optimizer step on the rows of ``grads``, the update that makes model ``version``
        (default: the next). The rows of an id that comes more than once are summed first
        (``IndexedRows.deduplicated``). Unknown ids are created first, or, when admission
        filters, only those it admits: the others' gradient rows are dropped (and counted)."""
        if self.optimizer is None:
            raise RuntimeError(f"embedding table {self.name!r} has no optimizer")
        version = self.version + 1 if version is None else version
        if self._admission is not None:
            grads = grads.deduplicated()  # the filter counts an id once per push
        ids, values = grads.ids, np.asarray(grads.values, np.float32)
        # New rows are logged below with this update, not also at their creation.
        positions = self._positions(ids, create=self._admission is None, fresh_touch=False,
                                    held=self._recent.positions(ids))
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
        ids, values, positions = self._touch(ids, values, positions, version)
        # One gather and one scatter of rows and slots together (a row and its slots share
        # cache lines); the optimizer runs on the block split into contiguous parts.
        block = self._gather(positions, self._rows.shape[1])
        parts = by_part(block, self.dim)
        slots = dict(zip(self._slot_names, parts[1:]))
        self.optimizer.apply(parts[0], values, slots, step, learning_rate)
        self._scatter(positions, by_row(parts, block))
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
        self._rows[positions, : self.dim] = rows[order]
        for name, cols in self._slot_columns.items():
            if name in slots:
                self._rows[positions, cols] = slots[name][order]
        self._touched[positions] = self.version if touched is None else touched[order]
        self._log_touch(positions)
        meta = meta or {}
        if "counters" in meta:
            self.counters = TableCounters.from_list(meta["counters"])
        if "sketch" in meta:
            self.set_policy(self.policy, meta)
        self._enforce_cap()

    # ------------------------------------------------------------ positions

    def _positions(self, ids: np.ndarray, create: bool, fresh_touch: bool = True,
                   held: np.ndarray | None = None) -> np.ndarray:
        """The position of each id (-1: not held, unless ``create``); ``held``: the positions
        a lookup of the same ids found (RecentPositions), instead of the index's."""
        positions = self._index.find(ids) if held is None else held
        ttl = self.policy.ttl_versions
        if ttl and positions.size:
            # Lazily: a row advance() has not reached yet is expired when it is read.
            expired = (positions >= 0) & (self._touched[np.maximum(positions, 0)] <= self.version - ttl)
            if expired.any():
                self._evict(np.unique(positions[expired]), ttl=True)
                positions[expired] = -1
        if not create:
            return positions
        missing = np.flatnonzero(positions < 0)
        if missing.size:
            # New rows in id order (one sort); an id twice in the batch gets one row.
            order = np.argsort(ids[missing])
            missing = missing[order]
            new_ids = ids[missing]
            first = np.concatenate(([True], new_ids[1:] != new_ids[:-1]))
            created = self._create(new_ids[first], log=fresh_touch)
            positions[missing] = created[np.cumsum(first) - 1]
        return positions

    def _touch(self, ids: np.ndarray, values: np.ndarray, positions: np.ndarray,
               version: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mark the rows at ``positions`` updated at ``version``; (ids, values, positions) with
        the rows of a repeated id summed, in the order ``IndexedRows.deduplicated`` gives.

        The rows of one id share a position: writing ``i`` at the i-th position and reading
        back finds a repeat where another index came back. ``_touched`` takes the marks, as
        its entries at those positions are written next anyway: two passes of 8,192 entries
        cost 80 us, sorting the ids to find repeats 190 us.
        """
        marks = np.arange(positions.size, dtype=np.int64)
        np.put(self._touched, positions, marks)
        repeated = not np.array_equal(np.take(self._touched, positions), marks)
        np.put(self._touched, positions, version)
        if repeated:
            order, starts = id_runs(ids)
            ids, values, positions = ids[order][starts], summed_runs(values, order, starts), positions[order][starts]
        return ids, values, positions

    def _create(self, new_ids: np.ndarray, log: bool = True) -> np.ndarray:
        """Rows for ``new_ids`` (unique, not held), at their initial values; their positions."""
        start = self._grow(new_ids.size - min(new_ids.size, self._free_count))  # may refuse: nothing taken yet
        reused = self._reuse(new_ids.size - (self._size - start))
        positions = np.concatenate([reused, np.arange(start, self._size, dtype=np.int64)])
        self._index.add(new_ids, positions)
        # Reused positions by index (a scatter); new ones, at the end, written in place.
        if reused.size:
            fresh = np.empty((reused.size, self._rows.shape[1]), np.float32)
            initial_rows(self.info.initializer, new_ids[: reused.size], self.dim, out=fresh[:, : self.dim])
            fresh[:, self.dim:] = self._fresh_slots
            self._scatter(reused, fresh)
        end = self._rows[start:self._size]
        initial_rows(self.info.initializer, new_ids[reused.size:], self.dim, out=end[:, : self.dim])
        end[:, self.dim:] = self._fresh_slots
        self.counters.admissions += int(new_ids.size)
        self._touched[positions] = self.version
        if log:
            self._log_touch(positions)
        return positions

    # Rows move as opaque items of ``width`` floats: NumPy gathers and scatters a 1-D array of
    # items one copy per row, 2 to 3 times faster than the same rows as 2-D float arrays (0.35
    # against 0.86 ms to gather 8,192 rows of Adam's 48 floats from a million, measured).

    def _items(self, width: int) -> np.ndarray:
        """The first ``width`` floats of every row, one item each (a view: drop it before a grow)."""
        return self._rows[:, :width].view(np.dtype((np.void, 4 * width)))[:, 0]

    def _gather(self, positions: np.ndarray, width: int) -> np.ndarray:
        """float32 [len(positions), width]: the first ``width`` floats of those rows (a copy)."""
        if width == self._rows.shape[1]:
            return np.take(self._rows, positions, axis=0)  # whole rows: take is faster still
        if self._rows.shape[1] * 4 <= _WHOLE_ROW_BYTES:
            return np.take(self._rows, positions, axis=0)[:, :width].copy()
        return self._items(width)[positions].view(np.float32).reshape(positions.size, width)

    def _scatter(self, positions: np.ndarray, block: np.ndarray) -> None:
        """Write ``block`` (float32 [len(positions), row width], C order) into those rows."""
        items = self._items(block.shape[1])
        items[positions] = np.ascontiguousarray(block).view(items.dtype)[:, 0]

    def _reuse(self, count: int) -> np.ndarray:
        self._free_count -= count
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
            self._log.append(positions, self._ids[positions], self._touched[positions], len(self),
                             self._ids, self._touched)

    def _enforce_cap(self) -> None:
        """Evict the least recently updated rows while the table holds more than max_rows."""
        cap = self.policy.max_rows
        if cap and len(self) > cap and self._log is not None:
            self._evict(self._log.pop(self._ids, self._touched, count=len(self) - cap).positions, ttl=False)

    def _evict(self, positions: np.ndarray, ttl: bool) -> None:
        if not positions.size:
            return
        self._index.remove(positions)
        self._recent.forget()  # those positions go to other ids
        self._free.append(positions)
        self._free_count += positions.size
        if ttl:
            self.counters.evictions_ttl += int(positions.size)
        else:
            self.counters.evictions_max_rows += int(positions.size)

    def _saved_order(self) -> np.ndarray:
        if self._log is not None:
            return self._log.live_order(self._ids, self._touched)
        return self._index.live_positions()

    def _grow(self, extra: int) -> int:
        start = self._size
        needed = start + extra
        if needed > self._rows.shape[0]:
            capacity = max(needed, 2 * self._rows.shape[0])
            try:
                self._index.resize(capacity)
            except OverflowError as err:
                raise EmbeddingError(f"embedding table {self.name!r}: {err}; bound it with max_rows "
                                     "(--embedding_max_rows) or spread it over more PS (--num_ps)") from None
            self._touched = self._rows = None  # no view may be alive while the mappings move
            self._touched = self._touched_map.resized(capacity)
            self._rows = self._rows_map.resized(capacity)
        self._touched_map.prefault(start, needed)
        self._rows_map.prefault(start, needed)
        self._size = needed
        return start


@dataclass
class FrozenTable:
    """A read-only copy of a table (evaluation snapshots): unknown ids read as zero rows."""

    info: TableInfo
    index: IdIndex
    rows: np.ndarray

    def lookup(self, ids: np.ndarray, create: bool = False) -> np.ndarray:
        positions = self.index.find(ids)
        out = np.zeros((ids.size, self.info.dim), np.float32)
        known = positions >= 0
        out[known] = self.rows[positions[known]]
        return out
