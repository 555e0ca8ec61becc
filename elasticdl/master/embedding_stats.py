"""Embedding tables in the job's report and TensorBoard: rows, admissions, evictions, dropped gradients.

Each PS reports its tables (``PSStats.embedding_tables``, model/embedding/policy.py); a table's
figures are summed over the PS that hold its rows.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def summarize_tables(ps_stats) -> dict[str, dict[str, int]]:
    """table -> its counters summed over the parameter servers (a PS of an older build: none)."""
    tables: dict[str, dict[str, int]] = {}
    for stats in ps_stats:
        for name, figures in getattr(stats, "embedding_tables", {}).items():
            total = tables.setdefault(name, {})
            for key, value in figures.items():
                total[key] = total.get(key, 0) + int(value)
    return dict(sorted(tables.items()))


def tensorboard_values(tables: dict[str, dict[str, int]]) -> dict[str, float]:
    """Scalars named ``embedding/<table>/<figure>``."""
    return {f"embedding/{name}/{key}": float(value) for name, figures in tables.items() for key, value in figures.items()}


def log_tables(tables: dict[str, dict[str, int]]) -> None:
    for name, t in tables.items():
        if t.get("admissions", 0) or t.get("rows", 0):
            logger.info(
                "embedding table %s: %d rows (%.1f MiB) on the parameter servers; %d admitted, %d gradient rows "
                "dropped (ids not admitted yet), %d rows expired (ttl), %d evicted (max_rows)",
                name, t.get("rows", 0), t.get("bytes", 0) / (1 << 20), t.get("admissions", 0),
                t.get("dropped_gradients", 0), t.get("evictions_ttl", 0), t.get("evictions_max_rows", 0),
            )


def report(ps_stats, tensorboard, epoch: int | None) -> dict[str, dict[str, int]]:
    """At an epoch's end (``epoch``) or the job's (None): the tables' figures to TensorBoard, at the
    model version; logged at the job's end."""
    tables = summarize_tables(ps_stats)
    if tables and tensorboard is not None:
        tensorboard.scalars(max((s.version for s in ps_stats), default=0), tensorboard_values(tables))
    if epoch is None:
        log_tables(tables)
    return tables
