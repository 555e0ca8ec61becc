"""Which row holds which id: a NumPy open-addressing hash over a batch of ids at a time.

An embedding table keeps its rows at *positions* of one growing block. ``IdIndex`` is the
map between ids and positions: ``ids[position]`` is the id a position holds (-1 when free),
and a hash table of int32 slots gives the position of an id. A slot holds a position, not the
id: the id is read back from ``ids``, which the table stores anyway, so the hash costs 4 bytes
per slot (8 to 16 bytes per row at the loads below) instead of a dict's ~100.

Every operation works on a whole batch with NumPy, with no Python per id:

- the home slot of an id is Fibonacci hashing (a multiply, the top bits), after an xor-shift
  so that ids differing only in their high bits spread too;
- lookups probe linearly in rounds: the first round reads each id's home slot (most ids
  stop there), later rounds read a window of WINDOW slots per id still looking, so a long
  cluster costs a few rounds, not one per slot;
- inserts of a batch race for free slots: all write, one per slot wins (the value read back
  is its own), the others go on probing from there;
- deletion leaves a tombstone (lookups go past it, inserts reuse it); the slots are rebuilt
  when live ids and tombstones fill MAX_LOAD of them. A rebuild leaves the load at most
  REBUILT_LOAD, so at least (MAX_LOAD - REBUILT_LOAD) of the capacity is inserted between two
  rebuilds: a rebuild's cost is amortized O(1) per insert, eviction churn included.

Measured against the alternatives on this machine (docs/embeddings.md, "The table"): a Python
dict (0.8-1 M ids/s), ``np.searchsorted`` on a sorted array (2.4-3.9 M ids/s, and inserts need a
merge), this index (7-13 M ids/s at load 0.5 for 8,192-id batches).
"""

from __future__ import annotations

import numpy as np

from elasticdl.model.embedding.memory import MappedArray

EMPTY = -1
TOMBSTONE = -2
MAX_LOAD = 0.5
REBUILT_LOAD = 0.35
WINDOW = 8
MIN_SLOTS = 1 << 11
REBUILD_CHUNK = 1 << 16  # slots re-inserted at a time
MAX_POSITIONS = (1 << 31) - 1  # slots are int32
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: Fibonacci hashing
_STEPS = np.arange(WINDOW, dtype=np.intp)


def _empty_slots(count: int) -> np.ndarray:
    mapped = MappedArray(count, (), np.int32)
    mapped.prefault(0, count)  # every page is written now: fault them in at once
    slots = mapped.array()
    slots.fill(EMPTY)
    return slots


class IdIndex:
    """ids <-> positions of one table. ``find``, ``add`` and ``remove`` take batches."""

    def __init__(self, capacity: int) -> None:
        self._ids_map: MappedArray | None = MappedArray(capacity, (), np.int64)
        self.ids = self._ids_map.array()  # the id at each position; -1: free
        self._end = 0  # positions at or past it were never used (``ids`` unwritten there)
        self._slots = _empty_slots(MIN_SLOTS)
        self._shift = np.uint64(64 - (MIN_SLOTS.bit_length() - 1))
        self._live = 0
        self._tombstones = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: int) -> bool:
        return bool(self.find(np.array([key], np.int64))[0] >= 0)

    def __iter__(self):
        return iter(self.ids[self.live_positions()].tolist())

    @property
    def nbytes(self) -> int:
        """The hash's own bytes (the ids are the rows' and counted with them)."""
        return self._slots.nbytes

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]

    def live_positions(self) -> np.ndarray:
        return np.flatnonzero(self.ids[: self._end] >= 0)

    def resize(self, capacity: int) -> None:
        """Room for positions up to ``capacity`` (the table's block grew)."""
        if capacity > MAX_POSITIONS:
            raise OverflowError(f"an embedding table holds at most {MAX_POSITIONS} rows per PS")
        self.ids = None  # no view may be alive while the mapping moves
        self.ids = self._ids_map.resized(capacity)

    def copy(self) -> IdIndex:
        """An independent copy (an evaluation snapshot's)."""
        out = IdIndex.__new__(IdIndex)
        out.ids = self.ids[: max(self._end, 2)].copy()  # >= 2: find reads ids[-1] and ids[-2] (masked)
        out._ids_map = None  # a copy is read, never grown
        out._end, out._slots, out._shift = self._end, self._slots.copy(), self._shift
        out._live, out._tombstones = self._live, self._tombstones
        return out

    # ------------------------------------------------------------ batches

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The position of each id (int64), -1 for ids not held."""
        return self._locate(keys, positions=True)

    def add(self, keys: np.ndarray, positions: np.ndarray) -> None:
        """Map ``keys`` (unique, not held) to ``positions`` (free, below ``capacity``)."""
        if not keys.size:
            return
        if self._live + self._tombstones + keys.size > MAX_LOAD * self._slots.size:
            self._rebuild(self._live + keys.size)
        end = int(positions.max()) + 1
        if end > self._end and self._ids_map is not None:
            self._ids_map.prefault(self._end, end)
        self.ids[positions] = keys
        self._end = max(self._end, end)
        self._insert(keys, positions.astype(np.int32))
        self._live += keys.size

    def remove(self, positions: np.ndarray) -> None:
        """Forget the ids at ``positions`` (unique, live); the positions become free."""
        if not positions.size:
            return
        found = self._locate(self.ids[positions])
        if (found < 0).any():
            raise RuntimeError("embedding index out of step with its rows: a removed position was not indexed")
        self._slots[found] = TOMBSTONE
        self.ids[positions] = -1
        self._live -= positions.size
        self._tombstones += positions.size

    # ------------------------------------------------------------ probing

    def _home(self, keys: np.ndarray) -> np.ndarray:
        k = np.ascontiguousarray(keys, np.int64).view(np.uint64)
        return ((k ^ (k >> np.uint64(29))) * _GOLDEN >> self._shift).astype(np.intp)

    def _locate(self, keys: np.ndarray, positions: bool = False) -> np.ndarray:
        """The slot holding each key's position, -1 where the key is not held; with
        ``positions``, the position itself (int64; the slot's value, read here anyway)."""
        slots, ids = self._slots, self.ids
        home = self._home(keys)
        held = np.take(slots, home)  # np.take: a plain gather, a little faster than slots[home]
        # ids[held] reads ids[-1] or ids[-2] at an empty slot or a tombstone: masked by held >= 0.
        hit = (held >= 0) & (np.take(ids, held) == keys)
        out = np.where(hit, held, -1).astype(np.int64) if positions else np.where(hit, home, -1)
        rest = np.flatnonzero(~hit & (held != EMPTY))
        mask = slots.size - 1
        start, keys = home[rest] + 1, keys[rest]
        while rest.size:  # ends: the slots are never full (MAX_LOAD), every probe meets an EMPTY
            window = (start[:, None] + _STEPS) & mask
            held = slots[window]
            match = (held >= 0) & (ids[held] == keys[:, None])
            stop = match | (held == EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(rest.size)
            done = stop[rows, first]
            found = done & match[rows, first]
            out[rest[found]] = (held if positions else window)[rows[found], first[found]]
            more = ~done
            rest, start, keys = rest[more], start[more] + WINDOW, keys[more]
        return out

    def _insert(self, keys: np.ndarray, positions: np.ndarray) -> None:
        slots = self._slots
        mask = slots.size - 1
        start = self._home(keys)
        pending = np.arange(keys.size)
        width = 1  # the first round tries each home slot alone, later ones a window
        while pending.size:
            if width == 1:  # each home slot alone: 1-D, without a window's argmax
                target = start & mask
                has = slots[target] < 0
            else:
                window = (start[:, None] + _STEPS[:width]) & mask
                free = slots[window] < 0
                first = free.argmax(axis=1)
                rows = np.arange(pending.size)
                has = free[rows, first]
                target = window[rows, first]
            cand = np.flatnonzero(has)
            where, mine = target[cand], positions[pending[cand]]
            before = slots[where]
            slots[where] = mine  # several may write one slot: the last write wins it
            won = slots[where] == mine
            self._tombstones -= int(np.count_nonzero(before[won] == TOMBSTONE))
            lost = np.ones(pending.size, bool)
            lost[cand[won]] = False
            # A loser goes on from the slot it lost (now taken); an id with no free slot in its
            # window goes on past the window.
            start = np.where(has, target, start + width)[lost]
            pending = pending[lost]
            width = WINDOW

    def _rebuild(self, live: int) -> None:
        """New slots for ``live`` ids at a load of at most REBUILT_LOAD; tombstones dropped."""
        count = max(MIN_SLOTS, 1 << int(np.ceil(np.log2(live / REBUILT_LOAD))))
        old = self._slots
        self._slots = _empty_slots(count)
        self._shift = np.uint64(64 - (count.bit_length() - 1))
        self._tombstones = 0
        # By chunks: temporaries the size of the whole index would stay in a PS's heap for good
        # (its malloc keeps freed memory, launch/api.py), some 40 bytes per row.
        for start in range(0, old.size, REBUILD_CHUNK):
            part = old[start:start + REBUILD_CHUNK]
            held = part[part >= 0]
            if held.size:
                self._insert(self.ids[held], held)
