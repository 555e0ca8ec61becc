"""Batch prediction outputs: per-task parts written by workers, joined in input order.

Without a model-zoo ``PredictionOutputsProcessor``, each prediction task writes its rows
to ``<prediction_outputs>/parts/<file-key>-<start>.npy``; a retried task overwrites its
own part, so every input record gets exactly one row. When the job ends the master joins
the parts in input order (files in the order given, records in file order) into
``<prediction_outputs>/predictions.csv``: one row per input record, one column per
output value, named after the model's outputs: ``probs_0, probs_1, ...`` for an output
``probs`` of 2 values, ``ctr`` for an output of one value (a dict of outputs by its keys, in
sorted order; a list by ``model.output_names``). A model whose outputs have no names
(a subclassed model returning a tensor or a list) gets ``output_0, output_1, ...``.
The names go to ``<prediction_outputs>/parts/columns.json`` with the parts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Sequence

import numpy as np

from elasticdl import fs
from elasticdl.data.sources import Shard

PARTS = "parts"
COLUMNS = "columns.json"  # the header of predictions.csv, written with the parts


def _part_path(outputs_dir: str, path: str, start: int) -> str:
    key = hashlib.sha1(os.path.abspath(path).encode(), usedforsecurity=False).hexdigest()[:12]  # a file name
    return fs.join(outputs_dir, PARTS, f"{key}-{start:012d}.npy")


def _flatten(predictions) -> np.ndarray:
    """One row per record, whatever the model returns (a tensor, a list or a dict of them)."""
    if isinstance(predictions, dict):
        parts = [predictions[k] for k in sorted(predictions)]
    elif isinstance(predictions, (list, tuple)):
        parts = list(predictions)
    else:
        parts = [predictions]
    arrays = [np.asarray(p).reshape(len(np.asarray(p)), -1) for p in parts]
    return np.concatenate(arrays, axis=1)


def output_names(model) -> list[str]:
    """The names of ``model``'s outputs (a functional model's, Keras 3 or 2); [] when it has none."""
    try:
        names = list(getattr(model, "output_names", None) or [])
    except Exception:  # a subclassed model that was never given outputs
        return []
    return [str(name) for name in names]


def column_names(predictions, names: list[str]) -> list[str]:
    """One name per column ``_flatten`` makes of ``predictions`` (one batch): each output's name,
    with ``_i`` per value when it has several."""
    if isinstance(predictions, dict):
        keys = sorted(predictions)
        parts = [(str(k), predictions[k]) for k in keys]
    elif isinstance(predictions, (list, tuple)):
        own = names if len(names) == len(predictions) else [f"output_{i}" for i in range(len(predictions))]
        parts = list(zip(own, predictions))
    else:
        parts = [(names[0] if len(names) == 1 else "output", predictions)]
    columns = []
    for name, values in parts:
        width = int(np.prod(np.shape(values)[1:], dtype=np.int64))
        columns += [name] if width == 1 else [f"{name}_{i}" for i in range(width)]
    return columns


def write_part(outputs_dir: str, path: str, start: int, batches: list, names: list[str] | None = None) -> int:
    """Write one task's predictions atomically; returns the number of rows. ``names``: the
    model's output names (``output_names``), for the columns of predictions.csv."""
    rows = np.concatenate([_flatten(b) for b in batches]) if batches else np.zeros((0, 0))
    target = _part_path(outputs_dir, path, start)
    fs.makedirs(fs.join(outputs_dir, PARTS))
    if names is not None and batches:  # every task writes the same header: the last one stays
        header = json.dumps(column_names(batches[0], names)).encode()
        fs.write_atomically(fs.join(outputs_dir, PARTS, COLUMNS), lambda f: f.write(header))
    fs.write_atomically(target, lambda f: np.save(f, rows))
    return len(rows)


def _header(outputs_dir: str, width: int) -> str:
    """The columns' names the workers wrote, or output_0, output_1, ... (none, or not this width)."""
    path = fs.join(outputs_dir, PARTS, COLUMNS)
    names = json.loads(fs.read_bytes(path)) if fs.exists(path) else []
    if len(names) != width:
        names = [f"output_{i}" for i in range(width)]
    return ",".join(names)


def join_parts(outputs_dir: str, shards: Sequence[Shard]) -> str:
    """Concatenate the parts in input order into predictions.csv; returns its path."""
    missing = [s for s in shards if not fs.exists(_part_path(outputs_dir, s.path, s.start))]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} prediction tasks wrote no output (first: {missing[0].path} "
            f"records {missing[0].start}-{missing[0].end}); see the worker logs"
        )
    rows = [np.load(io.BytesIO(fs.read_bytes(_part_path(outputs_dir, s.path, s.start)))) for s in shards]
    table = np.concatenate(rows) if rows else np.zeros((0, 0))
    out = fs.join(outputs_dir, "predictions.csv")
    header = _header(outputs_dir, table.shape[1] if table.ndim == 2 else 0)
    fs.write_atomically(out, lambda f: np.savetxt(f, table, delimiter=",", header=header, comments="", fmt="%.7g"))
    fs.rmtree(fs.join(outputs_dir, PARTS))
    return out
