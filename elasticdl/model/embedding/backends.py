"""Where an ``elasticdl.layers.Embedding`` gets its rows from, and how its gradients are caught.

A layer takes the backend in effect when it is *constructed* (``use_embedding_backend``):

- none: a plain local run of the model; the layer holds a Keras table like
  ``keras.layers.Embedding``;
- an ``EmbeddingTables`` (what a ``Trainer`` builds its model under): rows come from a
  source, one lookup per call of the layer for the unique ids of the batch. The source is
  in-process ``LocalTables`` until a worker connects the parameter servers;
- a frozen source (``FrozenTables``, export): each table is pulled once and becomes two
  weights of the layer, so the model needs no parameter server.

During a training step the ``Trainer`` opens ``recording(tape)``: each lookup then has the
tape watch the gathered rows and notes (table, unique ids, rows), and the gradient with
respect to those rows is the row gradient pushed to the PS.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from elasticdl.model.embedding.table import EmbeddingError, EmbeddingTable, TableInfo


class RowSource(Protocol):
    def lookup(self, name: str, ids: np.ndarray, create: bool, snapshot_id: int = 0) -> np.ndarray: ...


class LocalTables:
    """Tables in this process (numpy, get-or-create): submit-time checks, tests, a worker's start."""

    frozen = False

    def __init__(self) -> None:
        self.tables: dict[str, EmbeddingTable] = {}

    def register(self, info: TableInfo) -> None:
        if info.name not in self.tables:
            self.tables[info.name] = EmbeddingTable(info)

    def lookup(self, name: str, ids: np.ndarray, create: bool, snapshot_id: int = 0) -> np.ndarray:
        table = self.tables.get(name)
        if table is None:
            raise EmbeddingError(f"unknown embedding table {name!r}")
        return table.lookup(ids, create)


class FrozenTables:
    """Export: each table fetched whole, ``fetch(name) -> (ids, rows)``."""

    frozen = True

    def __init__(self, fetch: Callable[[str], tuple[np.ndarray, np.ndarray]]):
        self._fetch = fetch

    def register(self, info: TableInfo) -> None:
        pass

    def table(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self._fetch(name)

    def lookup(self, name: str, ids: np.ndarray, create: bool, snapshot_id: int = 0) -> np.ndarray:
        raise RuntimeError("a frozen table is read from the layer's own weights")


class EmbeddingTables:
    """The tables of one model and the source its layers read rows from.

    ``use(source)`` switches every layer of the model at once (a worker connects its
    ``PSClient``); ``snapshot_id`` makes non-training lookups read an evaluation snapshot.
    """

    def __init__(self, source: Any = None):
        self.source = source if source is not None else LocalTables()
        self.infos: dict[str, TableInfo] = {}
        self.snapshot_id = 0
        # The last lookup failure: TensorFlow turns it into an OpError inside the step, so
        # the Trainer re-raises the original (a worker rides out an unreachable PS by its type).
        self.error: Exception | None = None

    @property
    def frozen(self) -> bool:
        return bool(getattr(self.source, "frozen", False))

    def use(self, source: Any) -> None:
        self.source = source
        register = getattr(source, "register", None)
        for info in self.infos.values():
            if register is not None:
                register(info)

    def register(self, info: TableInfo) -> None:
        known = self.infos.get(info.name)
        if known is not None and known != info:
            raise EmbeddingError(
                f"two embedding layers use the table name {info.name!r} with different settings; "
                "give the layers distinct names"
            )
        self.infos[info.name] = info
        register = getattr(self.source, "register", None)
        if register is not None:
            register(info)

    def table(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.source.table(name)

    def lookup(self, name: str, ids: np.ndarray, create: bool) -> np.ndarray:
        snapshot = 0 if create else self.snapshot_id
        try:
            return self.source.lookup(name, ids, create, snapshot)
        except Exception as err:
            self.error = err
            raise


_BACKEND: contextvars.ContextVar[EmbeddingTables | None] = contextvars.ContextVar("elasticdl_embedding_backend", default=None)


@contextlib.contextmanager
def use_embedding_backend(backend: EmbeddingTables | None) -> Iterator[None]:
    """Layers constructed inside take ``backend`` (None: plain local layers)."""
    token = _BACKEND.set(backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_backend() -> EmbeddingTables | None:
    return _BACKEND.get()


# ---------------------------------------------------------------- gradients of the rows


@dataclass
class GradientRecorder:
    """The rows looked up during one traced training step, watched by its tape."""

    tape: Any
    records: list[tuple[str, Any, Any]] = field(default_factory=list)  # (table, unique ids, rows)

    def watch(self, table: str, ids, rows) -> None:
        self.tape.watch(rows)
        self.records.append((table, ids, rows))

    @property
    def sources(self) -> list:
        return [rows for _, _, rows in self.records]

    def row_gradients(self, grads: list) -> dict[str, tuple[Any, Any]]:
        """{table: (unique ids, summed gradient rows)}: duplicates within and across lookups summed."""
        import tensorflow as tf

        by_table: dict[str, list[tuple[Any, Any]]] = {}
        for (table, ids, _rows), grad in zip(self.records, grads):
            if grad is None:  # this lookup did not reach the loss
                continue
            # The gradient of tf.gather is IndexedSlices over the gathered positions: making
            # it dense sums the duplicate ids of the batch into one row per unique id.
            by_table.setdefault(table, []).append((ids, tf.convert_to_tensor(grad)))
        out = {}
        for table, parts in by_table.items():
            if len(parts) == 1:
                out[table] = parts[0]
                continue
            ids = tf.concat([p[0] for p in parts], axis=0)
            values = tf.concat([p[1] for p in parts], axis=0)
            unique, index = tf.unique(ids)
            out[table] = (unique, tf.math.unsorted_segment_sum(values, index, tf.shape(unique)[0]))
        return out


_RECORDER: contextvars.ContextVar[GradientRecorder | None] = contextvars.ContextVar("elasticdl_embedding_recorder", default=None)


@contextlib.contextmanager
def recording(tape) -> Iterator[GradientRecorder]:
    recorder = GradientRecorder(tape)
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def current_recorder() -> GradientRecorder | None:
    return _RECORDER.get()
