"""The PS core's embedding-table calls, and how the ones that change a table reach its backups.

A training lookup creates the rows of ids a table does not hold (at their initial values), and
any lookup may evict rows (expired ones on read, then the row cap): state that exists on the
primary alone unless it is forwarded. So, with ``--ps_replicas``, a lookup that changed its
table is numbered under the core's lock like a push (op ``lookup``: the table and the ids) and
forwarded before it is answered; the backup runs the same lookup on the same state and makes
the same rows, counters and evictions, bit for bit (docs/replicas.md). A lookup that only read
rows (the usual case once the ids are known) forwards nothing. Creating the tables is op
``tables``. A table's counters (admissions, evictions) are what tells a change: every row
created or removed is counted.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from elasticdl.model.embedding.policy import TableStats
from elasticdl.model.embedding.table import TableInfo, check_ids

logger = logging.getLogger(__name__)


class ShardTables:
    """The embedding-table side of ``ParameterServer`` (its attributes are the server's)."""

    def push_embedding_table_infos(self, infos: list[TableInfo]) -> None:
        """Create the model's tables (idempotent; a table restored from a checkpoint keeps its rows)."""
        entry = None
        with self._lock:
            for name in self.shard.add_tables(infos):
                logger.info("embedding table %s (dim %d)", name, self.shard.embeddings[name].dim)
            if infos:  # also a policy changed on a held table: the backups must make the same
                entry = self._replicate_locked("tables", list(infos))
        self._deliver(entry)

    def lookup_embeddings(self, name: str, ids: np.ndarray, create: bool, snapshot_id: int = 0) -> np.ndarray:
        """Rows of ``ids`` in table ``name``: unseen ids are initialized when ``create`` (training),
        else read as zero rows. With ``snapshot_id`` the rows of that evaluation snapshot."""
        entry = None
        with self._lock:
            table = self.shard.table(name)
            check_ids(name, ids, self.settings.ps_id, self.settings.num_ps)
            if snapshot_id > 0:
                frozen = self._table_snapshots.get(snapshot_id)
                if frozen is None:
                    raise KeyError(f"no snapshot {snapshot_id} on this PS (already dropped?)")
                if name not in frozen:  # a table made after the snapshot: nothing trained yet
                    return np.zeros((ids.size, table.dim), np.float32)
                return frozen[name].lookup(ids)
            # An unbounded table's lookup only makes rows at their initial values, which a push
            # of those ids makes on the backup too (apply creates unknown ids): not forwarded.
            forwards = self.replication is not None and table.policy.bounded
            before = dataclasses.replace(table.counters) if forwards else None
            rows = table.lookup(ids, create)
            if before is not None and table.counters != before:  # rows made or evicted: forwarded
                entry = self._replicate_locked("lookup", name, np.array(ids, np.int64), create)
        self._deliver(entry)  # answered once every backup made the same rows
        return rows

    def embedding_table(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows): every row of table ``name`` this PS holds (a copy, for export)."""
        with self._lock:
            ids, rows, _ = self.shard.table(name).state()
            return ids, rows

    def embedding_stats(self) -> list[TableStats]:
        """Each table's rows and admission/eviction counters (the master's report)."""
        with self._lock:
            return [t.stats() for t in self.shard.embeddings.values()]

    def embedding_tables(self) -> list[TableInfo]:
        with self._lock:
            return [t.info for t in self.shard.embeddings.values()]


def apply_lookup(core, name: str, ids: np.ndarray, create: bool) -> None:
    """A backup runs the primary's lookup: the same rows created, the same rows evicted."""
    with core._lock:
        core.shard.table(name).lookup(ids, create)
