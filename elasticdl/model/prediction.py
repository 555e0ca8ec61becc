"""Batch prediction outputs: per-task parts written by workers, joined in input order.

Without a model-zoo ``PredictionOutputsProcessor``, each prediction task writes its rows
to ``<prediction_outputs>/parts/<file-key>-<start>.npy``; a retried task overwrites its
own part, so every input record gets exactly one row. When the job ends the master joins
the parts in input order (files in the order given, records in file order) into
``<prediction_outputs>/predictions.csv``: one row per input record, one column per
output value (``output_0, output_1, ...``).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence

import numpy as np

from elasticdl import fs
from elasticdl.data.sources import Shard

PARTS = "parts"


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


def write_part(outputs_dir: str, path: str, start: int, batches: list) -> int:
    """Write one task's predictions atomically; returns the number of rows."""
    rows = np.concatenate([_flatten(b) for b in batches]) if batches else np.zeros((0, 0))
    target = _part_path(outputs_dir, path, start)
    fs.makedirs(fs.join(outputs_dir, PARTS))
    fs.write_atomically(target, lambda f: np.save(f, rows))
    return len(rows)


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
    header = ",".join(f"output_{i}" for i in range(table.shape[1] if table.ndim == 2 else 0))
    fs.write_atomically(out, lambda f: np.savetxt(f, table, delimiter=",", header=header, comments="", fmt="%.7g"))
    fs.rmtree(fs.join(outputs_dir, PARTS))
    return out
