"""PS shard checkpoints: ``<dir>/version-<v>/ps-<i>-of-<n>.term-<t>.npz``.

A checkpoint is a *cut*: every PS's shard at the same model version ``v``, written by
the master's leadership term ``t``. Each term writes its own lineage: a cut is complete
when all ``n`` shards of one term are there, and shards of two terms never make one cut
(a master cut off from etcd cannot mix its files into its successor's). Files without
``.term-<t>`` (older jobs) count as term 0.

Each shard also stores its data position (elasticdl/ps/data_position.py): per task, the
record offset up to which gradients were applied, and the records applied in all. A job
that goes back to the cut (a PS died, the master restarted) puts the records after that
position back to todo: every record's update is then in the model exactly once.

Each PS writes its own file atomically: a hidden temp file in the version directory,
fsynced, renamed over the final name, then the directory fsynced, so a crash or a full disk
leaves either the whole file or none (never a partial ``ps-*.npz``). A version directory
is complete when all ``n`` files are there. Restoring reads every file of a version and
keeps the variables that hash to this PS, so a job may restart on a different number
of parameter servers. On an object store (``s3://``, ``gs://``) a shard goes up in one put
followed by a ``.committed`` marker, and only marked shards count (elasticdl/fs/__init__.py).
Embedding tables are saved as their ids, rows and per-row slots;
restoring keeps the rows whose ``id % num_ps`` is this PS. Non-trainable variables
(``non_trainable:<name>``) are placed like the trainable ones (``param:<name>``).
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from elasticdl import fs
from elasticdl.errors import JobFailure, UserError
from elasticdl.model.embedding.table import TableInfo
from elasticdl.model.sharding import ps_for_variable

_VERSION_DIR = re.compile(r"^version-(\d+)$")
_SHARD_FILE = re.compile(r"^ps-(\d+)-of-(\d+)(?:\.term-(\d+))?\.npz$")


class CheckpointError(UserError, ValueError):
    """No usable checkpoint where one was asked for."""


class CheckpointWriteError(JobFailure, OSError):
    """A shard could not be written (a full disk, a directory that became unwritable); no
    partial file is left behind."""


@dataclass
class TableState:
    """One embedding table's rows on a PS: ids [n], rows [n, dim], slots {name: [n, dim]}."""

    info: TableInfo
    ids: np.ndarray
    rows: np.ndarray
    slots: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ShardState:
    version: int
    step: int
    params: dict[str, np.ndarray]
    slots: dict[str, dict[str, np.ndarray]]
    embeddings: dict[str, TableState] = field(default_factory=dict)
    marks: dict[int, int] = field(default_factory=dict)  # task id -> records applied up to this index
    records_applied: int = 0
    term: int = 0
    # Non-trainable variables (BatchNorm moving statistics): values by name, no slots.
    non_trainable: dict[str, np.ndarray] = field(default_factory=dict)


def save_shard(checkpoint_dir: str, ps_id: int, num_ps: int, state: ShardState) -> str:
    """Write this PS's shard of ``state`` atomically; its path. CheckpointWriteError on failure."""
    version_dir = fs.join(checkpoint_dir, f"version-{state.version}")
    path = fs.join(version_dir, shard_file_name(ps_id, num_ps, state.term))
    try:
        if not fs.is_remote(version_dir) and not os.path.isdir(version_dir):
            os.makedirs(version_dir, exist_ok=True)
            _fsync_dir(checkpoint_dir)  # the new version directory's entry
        write_atomically(path, lambda f: np.savez(f, **_arrays(state)))
    except OSError as err:
        raise CheckpointWriteError(
            f"could not write checkpoint {path}: {err.strerror or err}"
        ) from err
    return path


def shard_file_name(ps_id: int, num_ps: int, term: int) -> str:
    return f"ps-{ps_id}-of-{num_ps}.term-{term}.npz" if term else f"ps-{ps_id}-of-{num_ps}.npz"


def write_atomically(path: str, write) -> None:
    """``write(file)`` so that ``path`` is either the old file (or absent) or the whole new one
    (elasticdl/fs/__init__.py: fsync and rename on a local disk, one put and a commit marker on an
    object store)."""
    fs.write_atomically(path, write)


def _fsync_dir(directory: str) -> None:
    fs.fsync_dir(directory)


def _arrays(state: ShardState) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {
        "__version__": np.array(state.version, dtype=np.int64),
        "__step__": np.array(state.step, dtype=np.int64),
        "__marks__": np.array(sorted(state.marks.items()), dtype=np.int64).reshape(-1, 2),
        "__records_applied__": np.array(state.records_applied, dtype=np.int64),
        "__term__": np.array(state.term, dtype=np.int64),
    }
    for name, value in state.params.items():
        arrays[f"param:{name}"] = value
        for slot_name, slot in state.slots.get(name, {}).items():
            arrays[f"slot:{slot_name}:{name}"] = slot
    for name, value in state.non_trainable.items():
        arrays[f"non_trainable:{name}"] = value
    for name, table in state.embeddings.items():
        info = {"dim": table.info.dim, "initializer": table.info.initializer}
        arrays[f"embedding_info:{name}"] = np.array(json.dumps(info, sort_keys=True))
        arrays[f"embedding_ids:{name}"] = table.ids
        arrays[f"embedding_rows:{name}"] = table.rows
        for slot_name, slot in table.slots.items():
            arrays[f"embedding_slot:{slot_name}:{name}"] = slot
    return arrays


def complete_versions(checkpoint_dir: str) -> list[int]:
    """Versions with a complete cut (every shard of one term), oldest first: by term, then
    version, so the latest is the newest term's newest cut."""
    cuts = []
    for entry in fs.listdir(checkpoint_dir) if fs.isdir(checkpoint_dir) else []:
        match = _VERSION_DIR.match(entry)
        cut = match and _complete_term(fs.join(checkpoint_dir, entry))
        if cut:
            cuts.append((cut[0], int(match.group(1))))
    return [version for _, version in sorted(cuts)]


def _all_shard_files(version_dir: str) -> list[tuple[int, int, int, str]]:
    """(ps_id, num_ps, term, path) of every shard file in a version directory."""
    found = []
    for path in fs.glob(fs.join(version_dir, "ps-*-of-*.npz")):
        match = _SHARD_FILE.match(fs.basename(path))
        if match and fs.committed(path):  # on an object store: its marker is written
            found.append((int(match.group(1)), int(match.group(2)), int(match.group(3) or 0), path))
    return found


def _complete_term(version_dir: str) -> tuple[int, int] | None:
    """(term, num_ps) of the newest term whose every shard is in ``version_dir``; None if none."""
    by_cut: dict[tuple[int, int], set[int]] = {}
    for ps_id, num_ps, term, _ in _all_shard_files(version_dir):
        by_cut.setdefault((term, num_ps), set()).add(ps_id)
    complete = [cut for cut, ids in by_cut.items() if ids == set(range(cut[1]))]
    return max(complete) if complete else None


def _shard_files(version_dir: str) -> list[tuple[int, int, str]]:
    """(ps_id, num_ps, path) of the complete cut's files (the newest term's, if two are complete)."""
    cut = _complete_term(version_dir)
    if cut is None:
        return []
    return [(i, n, path) for i, n, term, path in _all_shard_files(version_dir) if (term, n) == cut]


def _is_complete(version_dir: str) -> bool:
    return _complete_term(version_dir) is not None


def cut_position(path: str) -> tuple[int, dict[int, int], list[int]]:
    """(version, marks, records applied per shard) of the cut at ``path`` (a version directory or
    a checkpoint dir: its latest complete cut). ``marks`` is each task's lowest mark over the
    shards: the records every shard applied (in sync mode all shards agree)."""
    version_dir = resolve_checkpoint(path)
    marks: dict[int, int] | None = None
    applied, version = [], 0
    for _, _, file in sorted(_shard_files(version_dir)):
        with np.load(_local_or_bytes(file)) as data:
            version = int(data["__version__"])
            shard = {int(t): int(e) for t, e in data["__marks__"]} if "__marks__" in data.files else {}
            applied.append(int(data["__records_applied__"]) if "__records_applied__" in data.files else 0)
        if marks is None:
            marks = shard
        else:  # a task a shard never saw was applied up to its start there: drop it
            marks = {t: min(e, shard[t]) for t, e in marks.items() if t in shard}
    return version, marks or {}, applied


def resolve_checkpoint(path: str) -> str:
    """A version directory: ``path`` itself, or the latest complete one under it."""
    if _VERSION_DIR.match(fs.basename(path if fs.is_remote(path) else os.path.normpath(path))):
        if not _is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete: some ps-*-of-*.npz files are missing")
        return path
    versions = complete_versions(path)
    if not versions:
        raise CheckpointError(
            f"no complete checkpoint under {path} (expected version-<N>/ps-<i>-of-<n>.npz)"
        )
    return fs.join(path, f"version-{versions[-1]}")


def version_of(version_dir: str) -> int:
    """N of a ``version-<N>`` directory."""
    return int(_VERSION_DIR.match(fs.basename(version_dir if fs.is_remote(version_dir)
                                              else os.path.normpath(version_dir))).group(1))


def load_shard(path: str, ps_id: int, num_ps: int) -> ShardState:
    """This PS's part of the checkpoint at ``path`` (re-sharded for ``num_ps``)."""
    version_dir = resolve_checkpoint(path)
    params: dict[str, np.ndarray] = {}
    non_trainable: dict[str, np.ndarray] = {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    tables: dict[str, list[TableState]] = {}
    version = step = term = 0
    marks: dict[int, int] = {}
    records_applied = 0
    files = sorted(_shard_files(version_dir))
    for shard_id, saved_num_ps, file in files:
        with np.load(_local_or_bytes(file)) as data:
            for name, table in _tables_in(data, ps_id, num_ps).items():
                tables.setdefault(name, []).append(table)
            version = int(data["__version__"])
            step = max(step, int(data["__step__"]))
            if "__term__" in data.files:
                term = int(data["__term__"])
            if shard_id == ps_id and saved_num_ps == num_ps and "__marks__" in data.files:
                # This shard's own data position: a batch it applied and another shard did not
                # (async) is skipped here when the job trains it again, applied there.
                marks = {int(t): int(e) for t, e in data["__marks__"]}
                records_applied = int(data["__records_applied__"])
            for key in data.files:
                kind, _, rest = key.partition(":")
                if kind == "param" and ps_for_variable(rest, num_ps) == ps_id:
                    params[rest] = data[key]
                elif kind == "non_trainable" and ps_for_variable(rest, num_ps) == ps_id:
                    non_trainable[rest] = data[key]
                elif kind == "slot":
                    slot_name, _, name = rest.partition(":")
                    if ps_for_variable(name, num_ps) == ps_id:
                        slots.setdefault(name, {})[slot_name] = data[key]
    if files and files[0][1] != num_ps:  # re-sharded: the position every old shard reached
        _, marks, applied = cut_position(version_dir)
        records_applied = min(applied)
    embeddings = {name: _concatenate(parts) for name, parts in tables.items()}
    return ShardState(version=version, step=step, params=params, slots=slots, embeddings=embeddings,
                      marks=marks, records_applied=records_applied, term=term, non_trainable=non_trainable)


def _local_or_bytes(file: str):
    """What np.load reads: a local path, or a remote shard's bytes."""
    return io.BytesIO(fs.read_bytes(file)) if fs.is_remote(file) else file


def _tables_in(data, ps_id: int, num_ps: int) -> dict[str, TableState]:
    """The rows of each table in one shard file that belong to PS ``ps_id`` of ``num_ps``."""
    found: dict[str, TableState] = {}
    masks: dict[str, np.ndarray] = {}
    for key in data.files:
        kind, _, name = key.partition(":")
        if kind == "embedding_info":
            info = json.loads(str(data[key]))
            ids = data[f"embedding_ids:{name}"]
            masks[name] = mine = ids % num_ps == ps_id
            found[name] = TableState(
                TableInfo(name, int(info["dim"]), info["initializer"]), ids[mine], data[f"embedding_rows:{name}"][mine]
            )
    for key in data.files:
        kind, _, rest = key.partition(":")
        if kind == "embedding_slot":
            slot_name, _, name = rest.partition(":")
            found[name].slots[slot_name] = data[key][masks[name]]
    return found


def _concatenate(parts: list[TableState]) -> TableState:
    if len(parts) == 1:
        return parts[0]
    slot_names = set.intersection(*(set(p.slots) for p in parts))
    return TableState(
        parts[0].info,
        np.concatenate([p.ids for p in parts]),
        np.concatenate([p.rows for p in parts]),
        {s: np.concatenate([p.slots[s] for p in parts]) for s in slot_names},
    )


def discard_after(checkpoint_dir: str, version: int, ps_id: int, term: int) -> list[str]:
    """Remove this PS's shard files of versions after ``version`` written by terms up to ``term``:
    the timeline a rollback to ``version`` abandoned. Training that version again writes them
    anew; a file left from before could otherwise complete a cut with shards of the new timeline.
    Returns the removed paths."""
    removed = []
    for entry in fs.listdir(checkpoint_dir) if fs.isdir(checkpoint_dir) else []:
        match = _VERSION_DIR.match(entry)
        if not match or int(match.group(1)) <= version:
            continue
        for shard_id, _, shard_term, path in _all_shard_files(fs.join(checkpoint_dir, entry)):
            if shard_id == ps_id and shard_term <= term:
                fs.remove(path)
                removed.append(path)
    return removed


def prune(checkpoint_dir: str, keep_max: int) -> None:
    """Keep the newest ``keep_max`` complete versions (0 keeps all)."""
    if keep_max <= 0:
        return
    for version in complete_versions(checkpoint_dir)[:-keep_max]:
        fs.rmtree(fs.join(checkpoint_dir, f"version-{version}"))
