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
of parameter servers; the slices of a large dense variable (elasticdl/model/slicing.py) are
joined and cut again for it. On an object store (``s3://``, ``gs://``) a shard goes up in one put
followed by a ``.committed`` marker, and only marked shards count (elasticdl/fs/__init__.py).
Embedding tables are saved as their ids, rows and per-row slots;
restoring keeps the rows whose ``id % num_ps`` is this PS. Non-trainable variables
(``non_trainable:<name>``) are placed like the trainable ones (``param:<name>``).

A shard counts only once its checksum verifies (elasticdl/model/checkpoint_integrity.py):
a damaged or partial newest cut is passed over, by name in the log, for the previous complete
one (``usable_cuts``); a damaged cut named explicitly (``version-<N>``) is an error naming the
file. A checkpoint directory belongs to one job, and each start of it is a *lineage* whose
terms lie above every term on disk before it (elasticdl/model/checkpoint_owner.py): pruning and
discarding take a ``floor`` and only ever touch terms above it, the lineage's own.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from elasticdl import fs
from elasticdl.errors import JobFailure
from elasticdl.model.checkpoint_integrity import (
    READ_ERRORS,
    CheckpointError,
    DamagedCheckpointError,
    open_shard,
    verify_shard,
    with_checksum,
)
from elasticdl.model.embedding.policy import TablePolicy, merged_meta
from elasticdl.model.embedding.table import TableInfo
from elasticdl.model.slice_restore import DenseRestore
from elasticdl.model.slicing import DEFAULT_SLICE_ABOVE_MB, DenseSlicing, SliceError

__all__ = ["CheckpointError", "CheckpointWriteError", "DamagedCheckpointError", "ShardState", "TableState"]

logger = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^version-(\d+)$")
_SHARD_FILE = re.compile(r"^ps-(\d+)-of-(\d+)(?:\.term-(\d+))?\.npz$")


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
    # A bounded table's resume state (model/embedding/policy.py): each row's last-update
    # version, and per-table arrays (counters, admission sketch).
    touched: np.ndarray | None = None
    meta: dict[str, np.ndarray] = field(default_factory=dict)


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
        write_atomically(path, lambda f: np.savez(f, **with_checksum(_arrays(state))))
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
        info = {"dim": table.info.dim, "initializer": table.info.initializer, "policy": table.info.policy.to_dict()}
        arrays[f"embedding_info:{name}"] = np.array(json.dumps(info, sort_keys=True))
        arrays[f"embedding_ids:{name}"] = table.ids
        arrays[f"embedding_rows:{name}"] = table.rows
        for slot_name, slot in table.slots.items():
            arrays[f"embedding_slot:{slot_name}:{name}"] = slot
        if table.touched is not None and table.info.policy.bounded:
            arrays[f"embedding_touched:{name}"] = table.touched
        for key, value in table.meta.items():
            arrays[f"embedding_meta:{key}:{name}"] = value
    return arrays


@dataclass(frozen=True)
class Cut:
    """A complete cut: every shard of one term at one version, its files in PS order."""

    version: int
    term: int
    num_ps: int
    directory: str
    files: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int]:
        """Newer cuts sort later: by term (a newer lineage's are above), then version."""
        return self.term, self.version


def complete_versions(checkpoint_dir: str, floor: int = -1) -> list[int]:
    """Versions with a complete cut (every shard of one term above ``floor``), oldest first: by
    term, then version, so the latest is the newest term's newest cut. Structural only: the
    files are not read (``usable_cuts`` verifies them)."""
    return [cut.version for cut in _cuts(checkpoint_dir, floor)]


def _version_dirs(checkpoint_dir: str) -> list[tuple[int, str]]:
    entries = fs.listdir(checkpoint_dir) if fs.isdir(checkpoint_dir) else []
    return [(int(m.group(1)), fs.join(checkpoint_dir, e)) for e in entries if (m := _VERSION_DIR.match(e))]


def _cuts(checkpoint_dir: str, floor: int = -1) -> list[Cut]:
    cuts = [cut for version, path in _version_dirs(checkpoint_dir) if (cut := _cut_of(path, version, floor))]
    return sorted(cuts, key=lambda cut: cut.key)


def _all_shard_files(version_dir: str) -> list[tuple[int, int, int, str]]:
    """(ps_id, num_ps, term, path) of every shard file in a version directory."""
    found = []
    for path in fs.glob(fs.join(version_dir, "ps-*-of-*.npz")):
        match = _SHARD_FILE.match(fs.basename(path))
        if match and fs.committed(path):  # on an object store: its marker is written
            found.append((int(match.group(1)), int(match.group(2)), int(match.group(3) or 0), path))
    return found


def _cut_of(version_dir: str, version: int | None = None, floor: int = -1) -> Cut | None:
    """The newest term's complete cut in ``version_dir`` (terms above ``floor``); None if none."""
    by_cut: dict[tuple[int, int], dict[int, str]] = {}
    for ps_id, num_ps, term, path in _all_shard_files(version_dir):
        if term > floor:
            by_cut.setdefault((term, num_ps), {})[ps_id] = path
    complete = [cut for cut, files in by_cut.items() if set(files) == set(range(cut[1]))]
    if not complete:
        return None
    term, num_ps = max(complete)
    files = by_cut[(term, num_ps)]
    return Cut(version_of(version_dir) if version is None else version, term, num_ps, version_dir,
               tuple(files[i] for i in range(num_ps)))


def _missing_shards(version_dir: str) -> str:
    """What an incomplete version directory lacks, for a message."""
    by_cut: dict[tuple[int, int], set[int]] = {}
    for ps_id, num_ps, term, _ in _all_shard_files(version_dir):
        by_cut.setdefault((term, num_ps), set()).add(ps_id)
    if not by_cut:
        return "it holds no ps-*-of-*.npz file"
    (term, num_ps), ids = max(by_cut.items())
    missing = ", ".join(shard_file_name(i, num_ps, term) for i in range(num_ps) if i not in ids)
    return f"{missing} {'is' if num_ps - len(ids) == 1 else 'are'} missing"


def verify_cut(cut: Cut) -> None:
    """DamagedCheckpointError unless every shard of ``cut`` reads whole and verifies."""
    for path in cut.files:
        verify_shard(path)


def usable_cuts(checkpoint_dir: str, floor: int = -1) -> Iterator[Cut]:
    """The complete cuts (terms above ``floor``) whose shards verify, newest first. A damaged
    or incomplete cut newer than the one returned is named in the log: the job, evaluate and
    predict say which checkpoint they passed over, and why."""
    cuts = _cuts(checkpoint_dir, floor)
    told = False
    for cut in reversed(cuts):
        try:
            verify_cut(cut)
        except DamagedCheckpointError as err:
            logger.warning("passed over checkpoint %s: %s; using the previous complete checkpoint", cut.directory, err)
            continue
        if not told:
            told = True
            _say_incomplete_after(checkpoint_dir, cut, floor, {c.directory for c in cuts})
        yield cut


def _say_incomplete_after(checkpoint_dir: str, chosen: Cut, floor: int, complete: set[str]) -> None:
    for version, path in sorted(_version_dirs(checkpoint_dir)):
        terms = [term for _, _, term, _ in _all_shard_files(path) if term > floor]
        if path not in complete and terms and (max(terms), version) > chosen.key:
            logger.warning("checkpoint %s is incomplete (%s): using %s, the newest complete one before it",
                           path, _missing_shards(path), chosen.directory)


def cut_position(path: str) -> tuple[int, dict[int, int], list[int]]:
    """(version, marks, records applied per shard) of the cut at ``path`` (a version directory or
    a checkpoint dir: its latest usable cut). ``marks`` is each task's lowest mark over the
    shards: the records every shard applied (in sync mode all shards agree). A file that cannot
    be read is a DamagedCheckpointError, never another exception."""
    cut = _resolve_cut(path)
    marks: dict[int, int] | None = None
    applied, version = [], 0
    for file in cut.files:
        with open_shard(file) as data:
            try:
                version = int(data["__version__"])
                shard = {int(t): int(e) for t, e in data["__marks__"]} if "__marks__" in data.files else {}
                applied.append(int(data["__records_applied__"]) if "__records_applied__" in data.files else 0)
            except READ_ERRORS as err:
                raise DamagedCheckpointError(file, f"its data position is unreadable ({type(err).__name__}: {err})") from None
        if marks is None:
            marks = shard
        else:  # a task a shard never saw was applied up to its start there: drop it
            marks = {t: min(e, shard[t]) for t, e in marks.items() if t in shard}
    return version, marks or {}, applied


def resolve_checkpoint(path: str, floor: int = -1) -> str:
    """A version directory: ``path`` itself if its cut verifies, or the latest usable cut under it
    (terms above ``floor``: a lineage's own)."""
    return _resolve_cut(path, floor).directory


def _is_version_dir(path: str) -> bool:
    return bool(_VERSION_DIR.match(fs.basename(path if fs.is_remote(path) else os.path.normpath(path))))


def _resolve_cut(path: str, floor: int = -1) -> Cut:
    if _is_version_dir(path):
        cut = _cut_of(path)
        if cut is None:
            raise CheckpointError(f"checkpoint {path} is incomplete: {_missing_shards(path)}. Pass its parent "
                                  "directory to use the newest complete checkpoint, or name another version-<N>")
        try:
            verify_cut(cut)
        except DamagedCheckpointError as err:
            raise CheckpointError(
                f"{err}. Pass the checkpoint directory {path.rstrip('/').rsplit('/', 1)[0]} to use the newest "
                "checkpoint that verifies, or name an older version-<N>"
            ) from None
        return cut
    for cut in usable_cuts(path, floor):
        return cut
    damaged = len(_cuts(path, floor))
    raise CheckpointError(
        f"no complete checkpoint under {path} (expected version-<N>/ps-<i>-of-<n>.npz)"
        + (f": {damaged} complete ones are damaged (see the log)" if damaged else "")
    )


def version_of(version_dir: str) -> int:
    """N of a ``version-<N>`` directory."""
    return int(_VERSION_DIR.match(fs.basename(version_dir if fs.is_remote(version_dir)
                                              else os.path.normpath(version_dir))).group(1))


def max_term(checkpoint_dir: str) -> int:
    """The highest term of any shard file under ``checkpoint_dir`` (0: none, or only older files)."""
    return max((term for _, path in _version_dirs(checkpoint_dir) for _, _, term, _ in _all_shard_files(path)),
               default=0)


def load_shard(path: str, ps_id: int, num_ps: int, slicing: DenseSlicing | None = None) -> ShardState:
    """This PS's part of the checkpoint at ``path`` (re-sharded for ``num_ps``; large dense
    variables sliced as ``slicing`` says: --slice_dense_above_mb, by default its default)."""
    cut = _resolve_cut(path)
    if slicing is None:
        slicing = DenseSlicing.from_flag(DEFAULT_SLICE_ABOVE_MB, num_ps)
    try:
        return _load_cut(cut, ps_id, num_ps, slicing)
    except DamagedCheckpointError:
        raise
    except READ_ERRORS as err:  # damaged after it verified (the file changed under us)
        raise DamagedCheckpointError(cut.directory, f"unreadable ({type(err).__name__}: {err})") from None


def _load_cut(cut: Cut, ps_id: int, num_ps: int, slicing: DenseSlicing) -> ShardState:
    # Dense variables: whole ones by name hash, sliced ones joined and cut again for num_ps.
    dense = DenseRestore(ps_id, num_ps, slicing)
    tables: dict[str, list[TableState]] = {}
    version = step = term = 0
    marks: dict[int, int] = {}
    records_applied = 0
    for shard_id, file in enumerate(cut.files):
        with open_shard(file) as data:
            # A bounded table's counters and sketch: this PS's own, or (re-sharded) the sum of the
            # old ones, the counters on PS 0 only so that job totals stay right.
            if cut.num_ps == num_ps:
                meta = "all" if shard_id == ps_id else ""
            else:
                meta = "all" if ps_id == 0 else "sketch"
            for name, table in _tables_in(data, ps_id, num_ps, meta).items():
                tables.setdefault(name, []).append(table)
            version = int(data["__version__"])
            step = max(step, int(data["__step__"]))
            if "__term__" in data.files:
                term = int(data["__term__"])
            if shard_id == ps_id and cut.num_ps == num_ps and "__marks__" in data.files:
                # This shard's own data position: a batch it applied and another shard did not
                # (async) is skipped here when the job trains it again, applied there.
                marks = {int(t): int(e) for t, e in data["__marks__"]}
                records_applied = int(data["__records_applied__"])
            for key in data.files:
                kind, _, rest = key.partition(":")
                if kind in ("param", "non_trainable"):
                    dense.add(kind, rest, data[key])
                elif kind == "slot":
                    slot_name, _, name = rest.partition(":")
                    dense.add(f"slot:{slot_name}", name, data[key])
    try:
        placed = dense.placed()
    except SliceError as err:
        raise DamagedCheckpointError(cut.directory, str(err)) from None
    params, non_trainable = placed.pop("param", {}), placed.pop("non_trainable", {})
    slots: dict[str, dict[str, np.ndarray]] = {}
    for group, arrays in placed.items():
        for name, value in arrays.items():
            slots.setdefault(name, {})[group.partition(":")[2]] = value
    if cut.num_ps != num_ps:  # re-sharded: the position every old shard reached
        _, marks, applied = cut_position(cut.directory)
        records_applied = min(applied)
    embeddings = {name: _concatenate(parts) for name, parts in tables.items()}
    return ShardState(version=version, step=step, params=params, slots=slots, embeddings=embeddings,
                      marks=marks, records_applied=records_applied, term=term, non_trainable=non_trainable)


def _tables_in(data, ps_id: int, num_ps: int, meta: str = "all") -> dict[str, TableState]:
    """The rows of each table in one shard file that belong to PS ``ps_id`` of ``num_ps``;
    ``meta``: which per-table arrays to take ("all", "sketch" or "")."""
    found: dict[str, TableState] = {}
    masks: dict[str, np.ndarray] = {}
    for key in data.files:
        kind, _, name = key.partition(":")
        if kind == "embedding_info":
            info = json.loads(str(data[key]))
            ids = data[f"embedding_ids:{name}"]
            masks[name] = mine = ids % num_ps == ps_id
            found[name] = TableState(
                TableInfo(name, int(info["dim"]), info["initializer"], TablePolicy.from_dict(info.get("policy"), name)),
                ids[mine], data[f"embedding_rows:{name}"][mine],
            )
    for key in data.files:
        kind, _, rest = key.partition(":")
        if kind == "embedding_slot":
            slot_name, _, name = rest.partition(":")
            found[name].slots[slot_name] = data[key][masks[name]]
        elif kind == "embedding_touched":
            found[rest].touched = data[key][masks[rest]]
        elif kind == "embedding_meta" and meta:
            meta_name, _, name = rest.partition(":")
            if meta == "all" or meta_name == meta:
                found[name].meta[meta_name] = data[key]
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
        np.concatenate([p.touched for p in parts]) if all(p.touched is not None for p in parts) else None,
        merged_meta([p.meta for p in parts]),
    )


def discard_after(checkpoint_dir: str, version: int, ps_id: int, term: int, floor: int = -1) -> list[str]:
    """Remove this PS's shard files of versions after ``version`` written by terms in (``floor``,
    ``term``]: the timeline a rollback to ``version`` abandoned, in this lineage only (an older
    lineage's cuts are not this job's to remove). Training that version again writes them anew;
    a file left from before could otherwise complete a cut with shards of the new timeline.
    Returns the removed paths."""
    removed = []
    for number, path in _version_dirs(checkpoint_dir):
        if number <= version:
            continue
        for shard_id, _, shard_term, file in _all_shard_files(path):
            if shard_id == ps_id and floor < shard_term <= term:
                fs.remove(file)
                removed.append(file)
    return removed


def prune(checkpoint_dir: str, keep_max: int, floor: int = -1) -> None:
    """Keep the newest ``keep_max`` complete cuts of terms above ``floor`` (0 keeps all): a
    lineage prunes only its own older cuts, never another lineage's (elasticdl/model/checkpoint_owner.py)."""
    if keep_max <= 0:
        return
    for cut in _cuts(checkpoint_dir, floor)[:-keep_max]:
        files = _all_shard_files(cut.directory)
        if all(term > floor for _, _, term, _ in files):
            fs.rmtree(cut.directory)
            continue
        for _, _, term, file in files:  # another lineage's shards share the version: theirs stay
            if term > floor:
                fs.remove(file)
