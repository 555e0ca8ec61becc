"""A shard's whole replicated state as bytes, for a new backup's catch-up (docs/replicas.md):
taken by the primary under its lock at sequence number s, loaded by the backup, which then
applies the entries after s.

What it holds is what an update changes: parameters, optimizer slots, non-trainable state,
step and version, the data position (marks, records, fences), the live-worker count, the
master's rate and the gradient guard's running norm, and each embedding table: its rows and
slots, each row's last-update version, its counters and admission sketch (``table:*`` arrays;
the backup's table then holds the same rows, values and counters). It is taken only between
two versions of a sync average (no gradient pending).
"""

from __future__ import annotations

import io
import json

import numpy as np

from elasticdl.model import checkpoint
from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.table import TableInfo


class SnapshotRefused(ValueError):
    """No snapshot now: a sync average is in progress."""


def take_locked(core) -> bytes:
    """The shard's state (call with ``core._lock`` held)."""
    if core.strategy.pending:
        raise SnapshotRefused(f"{core.strategy.pending} gradients wait in the sync average: asked again later")
    shard = core.shard
    meta = {
        "initialized": shard.initialized, "version": shard.version, "step": shard.step,
        "non_trainable": sorted(shard.non_trainable), "marks": sorted(core.position.marks.items()),
        "records_applied": core.position.records_applied, "fence_floor": core.position.fence_floor,
        "fenced": sorted(core.position.fenced), "grads_to_wait": core.strategy.grads_to_wait,
        "learning_rate": core._learning_rate, "guard": [core.guard.running_norm, core.guard.applied],
        "term": core.term,
    }
    arrays = {f"param:{n}": v for n, v in shard.params.items()}
    for name, slots in shard.slots.items():
        arrays.update({f"slot:{s}:{name}": v for s, v in slots.items()})
    for name, table in shard.embeddings.items():
        arrays.update(_table_arrays(name, table))
    buffer = io.BytesIO()
    np.savez(buffer, __meta__=np.array(json.dumps(meta)), **arrays)
    return buffer.getvalue()


def load(core, data: bytes) -> None:
    """Make ``core`` (a backup) the shard the snapshot was taken of."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        meta = json.loads(str(npz["__meta__"]))
        params, slots = {}, {}
        tables = _tables(npz)
        for key in npz.files:
            kind, _, rest = key.partition(":")
            if kind == "param":
                params[rest] = npz[key]
            elif kind == "slot":
                slot, _, name = rest.partition(":")
                slots.setdefault(name, {})[slot] = npz[key]
    if not meta["initialized"]:  # no model yet (it comes as an entry after the snapshot); tables may be
        with core._lock:
            core.shard.add_tables([table.info for table in tables.values()])
            for name, table in tables.items():
                core.shard.embeddings[name].load(table.ids, table.rows, table.slots, table.touched, table.meta)
        return
    held = set(meta["non_trainable"])
    state = checkpoint.ShardState(
        meta["version"], meta["step"], {n: v for n, v in params.items() if n not in held}, slots,
        marks={int(t): int(e) for t, e in meta["marks"]}, records_applied=meta["records_applied"],
        term=meta["term"], non_trainable={n: v for n, v in params.items() if n in held}, embeddings=tables,
    )
    with core._lock:
        core._load_locked(state, meta["fence_floor"])
        core.strategy.set_live_workers(core.shard, meta["grads_to_wait"])
        core.position.fenced = set(meta["fenced"])
        core._learning_rate = meta["learning_rate"]
        core.guard.running_norm, core.guard.applied = meta["guard"]
        core.term = max(core.term, meta["term"])


def _table_arrays(name: str, table) -> dict[str, np.ndarray]:
    """One table's arrays: its info, and what ``saved()`` gives, with the row versions and the
    counters also for an unbounded table (a checkpoint keeps them for bounded ones only; the
    table's ``load`` takes the counters from ``meta``, not counting the rows as admitted anew)."""
    ids, rows, slots, touched, meta = table.saved()
    info = {"dim": table.dim, "initializer": table.info.initializer, "policy": table.policy.to_dict()}
    arrays = {f"table_info:{name}": np.array(json.dumps(info, sort_keys=True)), f"table_ids:{name}": ids,
              f"table_rows:{name}": rows, f"table_touched:{name}": touched,
              f"table_meta:counters:{name}": np.array(table.counters.as_list(), np.int64)}
    arrays.update({f"table_slot:{slot}:{name}": value for slot, value in slots.items()})
    arrays.update({f"table_meta:{key}:{name}": value for key, value in meta.items() if key != "counters"})
    return arrays


def _tables(npz) -> dict[str, checkpoint.TableState]:
    found: dict[str, checkpoint.TableState] = {}
    for key in npz.files:
        kind, _, name = key.partition(":")
        if kind == "table_info":
            info = json.loads(str(npz[key]))
            found[name] = checkpoint.TableState(
                TableInfo(name, int(info["dim"]), info["initializer"], TablePolicy.from_dict(info["policy"], name)),
                npz[f"table_ids:{name}"], npz[f"table_rows:{name}"], touched=npz[f"table_touched:{name}"])
    for key in npz.files:
        kind, _, rest = key.partition(":")
        part, _, name = rest.partition(":")
        if kind == "table_slot":
            found[name].slots[part] = npz[key]
        elif kind == "table_meta":
            found[name].meta[part] = npz[key]
    return found


def begin_catch_up(core, backup: int) -> tuple[int, bytes]:
    """The primary's side of a new backup: under its lock, the snapshot and the number of the
    last update in it, and the backup added, so that every later update is forwarded to it too.
    SnapshotRefused when no snapshot can be taken now (the backup is not added)."""
    if core.replication is None:
        raise SnapshotRefused("this core is no primary (--ps_replicas not configured)")
    with core._lock:
        snapshot = take_locked(core)
        core.replication.add_backup(backup)
        return core.replication.seq, snapshot
