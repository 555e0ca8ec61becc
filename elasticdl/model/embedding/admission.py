"""Which new ids get a row: a count of sightings, or a per-sighting chance, decided alike everywhere.

Sightings are counted in a count-min sketch of fixed size (SKETCH_DEPTH x SKETCH_WIDTH uint32
counters, 2 MiB per table per PS), not in a dict per id: an endless stream of new ids cannot
grow it. A collision can only over-count, so an id may be admitted a little early, never late.
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
SKETCH_WIDTH = 1 << 18
_COUNT_STREAM = 0x5C000  # hash streams apart from the initializer's (which count up from 0)
_CHANCE_STREAM = 0xAD000


class AdmissionFilter:
    """Counts the sightings of ids the table does not hold, and says which of them get a row."""

    def __init__(self, policy: TablePolicy, seed: int, sketch: np.ndarray | None = None):
        self.policy = policy
        self.seed = seed
        self.sketch: np.ndarray | None = None
        if policy.admit_min_count > 1:
            shape = (SKETCH_DEPTH, SKETCH_WIDTH)
            self.sketch = sketch.astype(np.uint32) if sketch is not None and sketch.shape == shape else np.zeros(shape, np.uint32)
        self._keys = [keyed(seed, _COUNT_STREAM + d) for d in range(SKETCH_DEPTH)]

    def admit(self, ids: np.ndarray, step: int) -> np.ndarray:
        """A bool mask over ``ids`` (unique, not held): True where the id gets a row now. Counts
        this sighting of each of them."""
        admitted = np.zeros(ids.size, bool)
        if ids.size == 0:
            return admitted
        keys = ids.astype(U64)
        if self.sketch is not None:
            estimate = np.full(ids.size, np.iinfo(np.uint32).max, np.uint32)
            for depth, key in enumerate(self._keys):
                cells = (mix64(keys ^ key) % U64(SKETCH_WIDTH)).astype(np.int64)
                np.add.at(self.sketch[depth], cells, 1)  # add.at: two ids of one batch may share a cell
                estimate = np.minimum(estimate, self.sketch[depth][cells])
            admitted |= estimate >= self.policy.admit_min_count
        if self.policy.admit_probability < 1:
            draw = unit_interval(mix64(mix64(keys ^ keyed(self.seed, _CHANCE_STREAM)) + U64(step & 0xFFFFFFFFFFFF)))
            admitted |= draw < self.policy.admit_probability
        return admitted
