"""Which new ids get a row: a count of sightings, or a per-sighting chance, decided alike everywhere.

Sightings are counted in a count-min sketch of fixed size (SKETCH_DEPTH x SKETCH_WIDTH uint16
counters, 4 MiB per table per PS), not in a dict per id: an endless stream of new ids cannot
grow it. The sketch forgets, as TinyLFU's does: every HALVING_PERIOD sightings all its counters
are halved, so it keeps describing recent traffic (a single old sighting is gone after one
halving) and its cells never fill up. An id must thus reach ``admit_min_count`` sightings
within roughly that many sightings of ids the table does not hold. A collision only
over-counts: an id may be admitted early (a few percent of one-off ids at most), never late.

The chance draw hashes (table seed, id, optimizer step): the same on every PS and replica that
applies the same updates, and a fresh draw at each sighting (an unlucky id is not barred for good).

A sighting is an applied update that carries the id: one per push in async mode, one per model
version in sync mode (the averaged push), which is what a replica sees too.
"""

from __future__ import annotations

import numpy as np

from elasticdl.model.embedding.hashing import U64, keyed, mix64, unit_interval
from elasticdl.model.embedding.policy import TablePolicy

SKETCH_DEPTH = 2
SKETCH_WIDTH = 1 << 20
HALVING_PERIOD = SKETCH_WIDTH // 4  # sightings between halvings: at most 1/4 of a sighting per cell
_MAX = np.iinfo(np.uint16).max
_COUNT_STREAM = 0x5C000  # hash streams apart from the initializer's (which count up from 0)
_CHANCE_STREAM = 0xAD000


class AdmissionFilter:
    """Counts the sightings of ids the table does not hold, and says which of them get a row."""

    def __init__(self, policy: TablePolicy, seed: int, saved: dict[str, np.ndarray] | None = None):
        self.policy = policy
        self.seed = seed
        self.sketch: np.ndarray | None = None
        self.since_halving = 0
        if policy.admit_min_count > 1:
            self.sketch = np.zeros((SKETCH_DEPTH, SKETCH_WIDTH), np.uint16)
            old = (saved or {}).get("sketch")
            if old is not None and old.shape == self.sketch.shape:
                self.sketch[:] = np.minimum(old, _MAX)  # summed shards (re-sharding) saturate
                self.since_halving = int((saved or {}).get("sketch_since_halving", 0)) % HALVING_PERIOD
        self._keys = [keyed(seed, _COUNT_STREAM + d) for d in range(SKETCH_DEPTH)]

    def saved(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps to count on exactly after a restore."""
        if self.sketch is None:
            return {}
        return {"sketch": self.sketch.copy(), "sketch_since_halving": np.array(self.since_halving, np.int64)}

    def admit(self, ids: np.ndarray, step: int) -> np.ndarray:
        """A bool mask over ``ids`` (unique, not held): True where the id gets a row now. Counts
        this sighting of each of them."""
        admitted = np.zeros(ids.size, bool)
        if ids.size == 0:
            return admitted
        keys = ids.astype(U64)
        if self.sketch is not None:
            admitted |= self._count(keys) >= self.policy.admit_min_count
        if self.policy.admit_probability < 1:
            draw = unit_interval(mix64(mix64(keys ^ keyed(self.seed, _CHANCE_STREAM)) + U64(step & 0xFFFFFFFFFFFF)))
            admitted |= draw < self.policy.admit_probability
        return admitted

    def _count(self, keys: np.ndarray) -> np.ndarray:
        """Adds one sighting of each key; the estimated count of each (this one included)."""
        estimate = np.full(keys.size, _MAX, np.int64)
        for depth, key in enumerate(self._keys):
            cells = (mix64(keys ^ key) % U64(SKETCH_WIDTH)).astype(np.int64)
            row = self.sketch[depth]
            # bincount: two ids of one batch may share a cell; the add saturates instead of wrapping.
            cells_hit, hits = np.unique(cells, return_counts=True)
            row[cells_hit] = np.minimum(row[cells_hit].astype(np.int64) + hits, _MAX)
            estimate = np.minimum(estimate, row[cells])
        self.since_halving += keys.size
        if self.since_halving >= HALVING_PERIOD:
            self.sketch >>= 1
            self.since_halving %= HALVING_PERIOD
        return estimate
