"""A shard's whole replicated state as bytes, for a new backup's catch-up (docs/replicas.md):
taken by the primary under its lock at sequence number s, loaded by the backup, which then
applies the entries after s.

What it holds is what an update changes: parameters, optimizer slots, non-trainable state,
step and version, the data position (marks, records, fences), the live-worker count, the
master's rate and the gradient guard's running norm. It is taken only between two versions
of a sync average (no gradient pending); embedding tables are not carried yet.
"""

from __future__ import annotations

import io
import json

import numpy as np

from elasticdl.model import checkpoint


class SnapshotRefused(ValueError):
    """No snapshot now: a sync average is in progress, or the shard holds embedding tables."""


def take_locked(core) -> bytes:
    """The shard's state (call with ``core._lock`` held)."""
    if core.strategy.pending:
        raise SnapshotRefused(f"{core.strategy.pending} gradients wait in the sync average: asked again later")
    if core.shard.embeddings:
        raise SnapshotRefused("a shard with embedding tables cannot be copied to a new backup yet (docs/replicas.md)")
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
    buffer = io.BytesIO()
    np.savez(buffer, __meta__=np.array(json.dumps(meta)), **arrays)
    return buffer.getvalue()


def load(core, data: bytes) -> None:
    """Make ``core`` (a backup) the shard the snapshot was taken of."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        meta = json.loads(str(npz["__meta__"]))
        params, slots = {}, {}
        for key in npz.files:
            kind, _, rest = key.partition(":")
            if kind == "param":
                params[rest] = npz[key]
            elif kind == "slot":
                slot, _, name = rest.partition(":")
                slots.setdefault(name, {})[slot] = npz[key]
    if not meta["initialized"]:
        return  # nothing pushed yet: the model comes as an entry after the snapshot
    held = set(meta["non_trainable"])
    state = checkpoint.ShardState(
        meta["version"], meta["step"], {n: v for n, v in params.items() if n not in held}, slots,
        marks={int(t): int(e) for t, e in meta["marks"]}, records_applied=meta["records_applied"],
        term=meta["term"], non_trainable={n: v for n, v in params.items() if n in held},
    )
    with core._lock:
        core._load_locked(state, meta["fence_floor"])
        core.strategy.set_live_workers(core.shard, meta["grads_to_wait"])
        core.position.fenced = set(meta["fenced"])
        core._learning_rate = meta["learning_rate"]
        core.guard.running_norm, core.guard.applied = meta["guard"]
        core.term = max(core.term, meta["term"])


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
