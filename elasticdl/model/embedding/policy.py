"""How an embedding table bounds its memory: admission of new ids, expiry, a row cap.

A ``TablePolicy`` travels with the table's ``TableInfo`` (from the layer's arguments, or the
``--embedding_*`` flags for tables the automatic swap makes) and is kept in checkpoints.
``TableCounters`` are what the table did under it, reported per table (docs/embeddings.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from elasticdl.errors import UserError

MAX_ADMIT_MIN_COUNT = 65535
MAX_COUNT = 1 << 62


class PolicyError(UserError, ValueError):
    """A bad admission or eviction setting; names the argument (and flag) to change."""


@dataclass(frozen=True)
class TablePolicy:
    """Bounds on one table's rows (the defaults bound nothing: every id gets a row for good).

    admit_min_count: an id not held gets a row at its ``admit_min_count``-th sighting (1: the
        first); until then it reads the zero row and its gradient is dropped.
    admit_probability: else each sighting admits it with this probability (1: off).
    ttl_versions: a row not updated for this many model versions is removed (0: never).
    max_rows: at most this many rows per table per PS; the least recently updated go first (0: no cap).
    """

    admit_min_count: int = 1
    admit_probability: float = 1.0
    ttl_versions: int = 0
    max_rows: int = 0

    def __post_init__(self) -> None:
        # admit_min_count: the sketch's counters saturate at 65535; the others stay in int64 arithmetic.
        for name, low, high in (("admit_min_count", 1, MAX_ADMIT_MIN_COUNT), ("ttl_versions", 0, MAX_COUNT),
                                ("max_rows", 0, MAX_COUNT)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise PolicyError(f"`{name}` must be an integer >= {low} and <= {high}. Received: {name}={value!r}")
        p = self.admit_probability
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p) or not 0 < p <= 1:
            raise PolicyError(
                f"`admit_probability` must be a number in (0, 1] (1: every id is admitted). Received: admit_probability={p!r}"
            )

    @property
    def filters_admission(self) -> bool:
        return self.admit_min_count > 1 or self.admit_probability < 1

    @property
    def evicts(self) -> bool:
        return self.ttl_versions > 0 or self.max_rows > 0

    @property
    def bounded(self) -> bool:
        return self.filters_admission or self.evicts

    def to_dict(self) -> dict:
        """The settings that differ from the defaults (empty for an unbounded table)."""
        default = TablePolicy()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    @classmethod
    def from_dict(cls, data: dict | None, table: str = "") -> TablePolicy:
        if not data:
            return cls()
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise PolicyError(f"embedding table {table!r}: policy must be a dict of {sorted(known)}. Received: {data!r}")
        try:
            return cls(**{k: (float(v) if k == "admit_probability" and isinstance(v, int) else v) for k, v in data.items()})
        except PolicyError as err:
            raise PolicyError(f"embedding table {table!r}: {err}") from None

    def merged(self, defaults: TablePolicy) -> TablePolicy:
        """This policy, with each setting left at its default taken from ``defaults`` (the flags)."""
        mine = self.to_dict()
        return TablePolicy(**{**defaults.to_dict(), **mine})


# The counters, in the order a checkpoint stores them.
COUNTER_NAMES = ("admissions", "dropped_gradients", "evictions_ttl", "evictions_max_rows")


@dataclass
class TableCounters:
    """What one table on one PS did since the job started (kept in checkpoints).

    admissions: rows created (an id admitted, or re-admitted after an eviction);
    dropped_gradients: gradient rows dropped because their id was not admitted (yet);
    evictions_ttl / evictions_max_rows: rows removed by expiry / by the cap.
    """

    admissions: int = 0
    dropped_gradients: int = 0
    evictions_ttl: int = 0
    evictions_max_rows: int = 0

    def as_list(self) -> list[int]:
        return [getattr(self, name) for name in COUNTER_NAMES]

    @classmethod
    def from_list(cls, values) -> TableCounters:
        return cls(**{name: int(v) for name, v in zip(COUNTER_NAMES, values)})


@dataclass(frozen=True)
class TableStats:
    """One table on one PS, as the master's report and TensorBoard show it."""

    name: str
    rows: int
    bytes: int
    counters: TableCounters

    def as_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "bytes": self.bytes, **asdict(self.counters)}


def merged_meta(parts: list[dict]) -> dict:
    """The saved counters and sketches of several old shards of one table, summed (re-sharding:
    a sketch of the sum over-counts, so an id may be admitted early, never late)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            value = np.asarray(value, np.int64)  # no wrap-around when summing small counters
            out[key] = out[key] + value if key in out else value.copy()
    return out
