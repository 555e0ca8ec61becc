"""The positions of a table's last few looked-up id batches, so a push of the same ids skips the hash.

A worker looks up the unique ids of a minibatch, then pushes one gradient row for each of
those ids, in the same order: the PS would hash the same batch twice. The table keeps the
positions each lookup found (ids all held) for the next pushes; a push whose ids equal a
remembered batch takes its positions (one comparison of the ids, some 5 us for 8,192 ids,
against 200 us to hash them).

A position stays the id's while the id is held: rows are created at free positions and
never moved. Only the removal of rows (eviction, by age or by the row cap) frees positions
for other ids, so the table forgets every remembered batch when it removes rows.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# Batches remembered per table: a few workers' lookups between a lookup and its push.
RECENT_BATCHES = 8


class RecentPositions:
    def __init__(self, size: int = RECENT_BATCHES) -> None:
        self._batches: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=size)

    def remember(self, ids: np.ndarray, positions: np.ndarray) -> None:
        """``positions`` (all held, >= 0) are those of ``ids`` until ``forget``."""
        if ids.size:
            # Copies: the caller's arrays may be written later (a gRPC buffer reused).
            self._batches.append((np.array(ids, np.int64), np.array(positions, np.int64)))

    def positions(self, ids: np.ndarray) -> np.ndarray | None:
        """The remembered positions of ``ids`` (same ids, same order), or None. Given away:
        the batch is forgotten (a batch is pushed once; its room goes to the next)."""
        for i in range(len(self._batches) - 1, -1, -1):
            held, positions = self._batches[i]
            if held.size == ids.size and np.array_equal(held, ids):
                del self._batches[i]
                return positions
        return None

    def forget(self) -> None:
        self._batches.clear()
