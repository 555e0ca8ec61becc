"""The order in which a table's rows were last updated, oldest first, without a scan per step.

Every update appends (row position, id, version) to a log; an entry whose row has been updated
again (or evicted) since is stale and skipped when it reaches the front. The front is thus the
least recently updated row: expiry (ttl) and the row cap (LRU) both pop from it, so either costs
what it removes plus the stale entries it passes, amortized O(1) per update. The log is
compacted (stale entries dropped) when it holds more than twice the live rows: again amortized.

Recency is the version of a row's last *update* (or creation), not of its last read: updates
are what every replica of a shard applies alike, so they evict the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_INITIAL = 1024


@dataclass
class Popped:
    positions: np.ndarray  # rows to evict, oldest first, unique
    exhausted: bool  # the log front is past what was asked (nothing older is left)


class RecencyLog:
    def __init__(self) -> None:
        self._pos = np.empty(_INITIAL, np.int64)
        self._id = np.empty(_INITIAL, np.int64)
        self._ver = np.empty(_INITIAL, np.int64)
        self._head = 0
        self._tail = 0

    def __len__(self) -> int:
        return self._tail - self._head

    def append(self, positions: np.ndarray, ids: np.ndarray, version: int, live_rows: int,
               row_ids: np.ndarray, touched: np.ndarray) -> None:
        n = positions.size
        if self._tail + n > self._pos.size:
            self._make_room(n, live_rows, row_ids, touched)
        end = self._tail + n
        self._pos[self._tail:end] = positions
        self._id[self._tail:end] = ids
        self._ver[self._tail:end] = version
        self._tail = end

    def pop(self, row_ids: np.ndarray, touched: np.ndarray, count: int | None = None,
            older_than: int | None = None, budget: int = 1 << 62) -> Popped:
        """Take the oldest live rows from the front: ``count`` of them, or those last updated at a
        version <= ``older_than``, looking at no more than ``budget`` entries. The taken rows'
        entries are consumed; the caller evicts them."""
        taken: list[np.ndarray] = []
        wanted = count if count is not None else 1 << 62
        scanned = 0
        while wanted > 0 and self._head < self._tail and scanned < budget:
            chunk = min(self._tail - self._head, max(2 * min(wanted, 1 << 20), 1024), budget - scanned)
            lo, hi = self._head, self._head + chunk
            pos, ver = self._pos[lo:hi], self._ver[lo:hi]
            live = (row_ids[pos] == self._id[lo:hi]) & (touched[pos] == ver)
            stop = hi
            if older_than is not None:
                young = np.flatnonzero(ver > older_than)
                if young.size:
                    stop = lo + int(young[0])
                    live[stop - lo:] = False
            picks = np.flatnonzero(live)
            if picks.size:
                # An identical entry twice (a row evicted and made again at one version) is one row.
                _, first = np.unique(pos[picks], return_index=True)
                picks = picks[np.sort(first)]
            if picks.size >= wanted:
                picks = picks[:wanted]
                stop = lo + int(picks[-1]) + 1
            taken.append(pos[picks])
            wanted -= picks.size
            scanned += stop - lo
            self._head = stop
            if stop < hi:  # a young entry (or the count) stopped us: the rest stays
                break
        positions = np.concatenate(taken) if taken else np.empty(0, np.int64)
        return Popped(positions, self._head >= self._tail)

    def live_order(self, row_ids: np.ndarray, touched: np.ndarray) -> np.ndarray:
        """The positions of the live rows, least recently updated first (for checkpoints)."""
        lo, hi = self._head, self._tail
        pos = self._pos[lo:hi]
        live = np.flatnonzero((row_ids[pos] == self._id[lo:hi]) & (touched[pos] == self._ver[lo:hi]))
        _, first = np.unique(pos[live], return_index=True)
        return pos[live[np.sort(first)]]

    def _make_room(self, extra: int, live_rows: int, row_ids: np.ndarray, touched: np.ndarray) -> None:
        """Drop stale entries when they are most of the log, else grow it (amortized O(1))."""
        length = self._tail - self._head
        if length > 2 * live_rows:
            keep = self.live_order(row_ids, touched)
            # live_order keeps each row's first live entry; a row has one live entry, so order holds.
            ids, ver = row_ids[keep], touched[keep]
            self._pos[: keep.size], self._id[: keep.size], self._ver[: keep.size] = keep, ids, ver
            self._head, self._tail = 0, keep.size
        elif self._head >= self._pos.size // 2:  # moving costs no more than the room it makes
            self._pos[:length] = self._pos[self._head:self._tail]
            self._id[:length] = self._id[self._head:self._tail]
            self._ver[:length] = self._ver[self._head:self._tail]
            self._head, self._tail = 0, length
        if self._tail + extra > self._pos.size:
            capacity = max(self._tail + extra, 2 * self._pos.size)
            for name in ("_pos", "_id", "_ver"):
                grown = np.empty(capacity, np.int64)
                grown[: self._tail] = getattr(self, name)[: self._tail]
                setattr(self, name, grown)
