"""Rows of an embedding table as they travel: ids with one row each, and their checks.

Gradients travel as ``IndexedRows`` (unique ids, one summed row per id); sync mode sums the
rows of several pushes per id (``RowGradientSum``). The checks raise EmbeddingError naming
the table and what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elasticdl.model.embedding.errors import EmbeddingError


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
        """Duplicate ids summed into one row each (ids sorted when there were duplicates).

        Workers send unique ids, so the common case is only the check: one sort of the ids.
        Duplicates are summed by segment (a stable argsort, then ``np.add.reduceat``), not by
        ``np.add.at`` (an unbuffered scatter, element by element).
        """
        ids = self.ids
        if ids.size < 2:
            return self
        ordered = np.sort(ids)
        if not (ordered[1:] == ordered[:-1]).any():
            return self
        order, starts = id_runs(ids)
        return IndexedRows(ids[order][starts], summed_runs(self.values, order, starts))

    def select(self, mask: np.ndarray) -> IndexedRows:
        return IndexedRows(self.ids[mask], self.values[mask])


def id_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): ``ids[order]`` sorted (stable), ``starts`` the first index of each run
    of one id in it. ``deduplicated`` sums rows by these runs; the table (which finds
    duplicates through its index, not by a sort) sums them the same way."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    return order, np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))


def summed_runs(values: np.ndarray, order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The rows of each run of ``id_runs``, summed (float32 [len(starts), dim])."""
    return np.add.reduceat(np.asarray(values, np.float32)[order], starts, axis=0)


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
