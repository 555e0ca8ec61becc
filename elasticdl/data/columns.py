"""Column records: a Parquet row range as numpy columns, for a model that reads columns.

With ``--data_reader_params records=columns`` a Parquet task reaches ``dataset_fn`` not as
one serialized tf.train.Example per row but as its columns: ``Columns`` holds each column
as one numpy array of values (and, for a list column, the row offsets into it), taken
from pyarrow's Arrow arrays with at most a cast. Building an Example per row costs about
2 µs a row in numpy (elasticdl/data/examples.py), several times what pyarrow takes to
read the row; the columns cost almost nothing beyond the read.

Types follow the Example path's features (docs/model_zoo.md, "Parquet rows"), so a model
moves between the two paths without changing its dtypes: integers, booleans, dates and
timestamps become int64, floating point float32, strings and binary bytes. A list column
(multi-hot ids; nested lists flattened) is values plus offsets, a struct column one column
per field named ``parent.child``. A null in a list column is an empty list; a null in a
scalar column has no value to give, and is refused with the row and the column named.

``Columns`` behaves as the sequence of its rows where a worker needs one: its length, a
slice or a selection of rows (a batch cut from the task, the rows left after a bad one is
skipped), so task accounting and the bisection for bad records work on it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from elasticdl.data.errors import DataError
from elasticdl.data.examples import flatten_structs


@dataclass(frozen=True)
class Column:
    """One column of ``rows`` rows: row r is ``values[r]``, or ``values[offsets[r]:offsets[r + 1]]``
    for a list column."""

    name: str
    values: np.ndarray  # int64, float32, bool or object (bytes)
    offsets: np.ndarray | None = None  # int64 [rows + 1], a list column only

    @property
    def is_list(self) -> bool:
        return self.offsets is not None

    @property
    def kind(self) -> str:
        """"int64", "float32" or "string": the tensor's dtype."""
        return "string" if self.values.dtype == object else self.values.dtype.name

    def __len__(self) -> int:
        return len(self.values) if self.offsets is None else len(self.offsets) - 1

    def rows(self, start: int, stop: int) -> Column:
        if self.offsets is None:
            return Column(self.name, self.values[start:stop])
        offsets = self.offsets[start:stop + 1]
        return Column(self.name, self.values[offsets[0]:offsets[-1]], offsets - offsets[0])

    def take(self, rows: np.ndarray) -> Column:
        if self.offsets is None:
            return Column(self.name, self.values[rows])
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lens = ends - starts
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        # index of every kept value: its row's start plus its place in the row
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lens)
        return Column(self.name, self.values[np.repeat(starts, lens) + within], offsets)


class Columns(Sequence):
    """The rows of a task as columns; a slice or ``take`` of it is Columns too."""

    def __init__(self, columns: Sequence[Column], rows: int):
        self.columns = list(columns)
        self._rows = rows
        self._chunks: dict[int, list[tuple[np.ndarray, ...]]] = {}  # size -> chunks(size), once cut

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def layout(self) -> tuple[tuple[str, str, bool], ...]:
        """(name, dtype, is a list) per column: what a pipeline fed these columns is built for."""
        return tuple((c.name, c.kind, c.is_list) for c in self.columns)

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._rows)
            if step != 1:
                return self.take(np.arange(start, stop, step))
            stop = max(start, stop)
            return Columns([c.rows(start, stop) for c in self.columns], stop - start)
        if index < 0:
            index += self._rows
        if not 0 <= index < self._rows:
            raise IndexError(f"row {index} of {self._rows}")
        return self[index:index + 1]

    def take(self, rows: Sequence[int]) -> Columns:
        rows = np.asarray(rows, np.int64)
        return Columns([c.take(rows) for c in self.columns], len(rows))

    def components(self) -> list[np.ndarray]:
        """What a pipeline is fed: per column its values, then its offsets for a list column."""
        arrays = []
        for column in self.columns:
            arrays.append(column.values)
            if column.offsets is not None:
                arrays.append(column.offsets)
        return arrays

    def chunks(self, size: int) -> list[tuple[np.ndarray, ...]]:
        """``components()`` of rows [0, size), [size, 2 size), ...: views, cut per column in one pass.

        A task is hundreds of chunks: the whole chunks of a scalar column are the rows of one
        2-D view, and a list column's offsets are rebased for all whole chunks in one numpy
        step (over a strided view of the offsets: consecutive chunks share their boundary).
        The chunks are cut once per size: a worker cuts a task read ahead in the thread that
        read it, and feeds them when the task comes.
        """
        if size not in self._chunks:
            self._chunks[size] = self._cut(size)
        return self._chunks[size]

    def _cut(self, size: int) -> list[tuple[np.ndarray, ...]]:
        n = -(-self._rows // size)
        whole = self._rows // size  # chunks of exactly ``size`` rows; the last may be shorter
        per_column = []
        for column in self.columns:
            if column.offsets is None:
                parts = list(column.values[:whole * size].reshape(whole, size, *column.values.shape[1:]))
                if whole < n:
                    parts.append(column.values[whole * size:])
                per_column.append(parts)
                continue
            offsets = column.offsets
            bounds = offsets[::size].tolist() + ([int(offsets[-1])] if self._rows % size else [])
            per_column.append([column.values[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
            step = offsets.strides[0]
            windows = np.lib.stride_tricks.as_strided(offsets, (whole, size + 1), (size * step, step), writeable=False)
            parts = list(windows - offsets[:whole * size:size, None]) if whole else []
            if whole < n:
                parts.append(offsets[whole * size:] - offsets[whole * size])
            per_column.append(parts)
        return list(zip(*per_column))

    def __repr__(self) -> str:
        return f"Columns({self._rows} rows: {', '.join(self.names)})"


class ColumnStream(Sequence):
    """A task's Columns arriving a row group at a time (read ahead while earlier rows train).

    Its length is known from the start; ``chunks`` hands out rows as they arrive. Anything
    else (a slice, ``take``, ``columns``) waits for every row and serves them as Columns.
    """

    def __init__(self, pieces: Iterator[Columns], rows: int):
        self._pieces = pieces
        self._error: BaseException | None = None  # a failed read: every later use raises it again
        self._first = self._next()  # the layout, and the rows the first batches need
        self._rows = rows
        self._arrived = [self._first]
        self._all: Columns | None = None

    def _next(self) -> Columns | None:
        if self._error is not None:
            raise self._error
        try:
            return next(self._pieces, None)
        except BaseException as err:
            self._error = err
            raise

    @property
    def layout(self) -> tuple[tuple[str, str, bool], ...]:
        return self._first.layout

    @property
    def names(self) -> tuple[str, ...]:
        return self._first.names

    def __len__(self) -> int:
        return self._rows

    def chunks(self, size: int) -> Iterator[list[np.ndarray]]:
        """As Columns.chunks, each chunk as soon as its rows have arrived."""
        if self._all is not None:
            yield from self._all.chunks(size)
            return
        pending, carry = self._first, None
        while True:
            whole = (len(pending) // size) * size
            yield from pending[:whole].chunks(size)
            carry = pending[whole:]
            piece = self._next()
            if piece is None:
                break
            self._arrived.append(piece)
            pending = concat([carry, piece]) if len(carry) else piece
        if len(carry):
            yield carry.components()
        self.materialize()

    def materialize(self) -> Columns:
        if self._all is None:
            while (piece := self._next()) is not None:
                self._arrived.append(piece)
            self._all = self._arrived[0] if len(self._arrived) == 1 else concat(self._arrived)
        return self._all

    def close(self) -> None:
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()  # a read-ahead thread stops after the row group it is reading

    @property
    def columns(self) -> list[Column]:
        return self.materialize().columns

    def __getitem__(self, index):
        return self.materialize()[index]

    def take(self, rows: Sequence[int]) -> Columns:
        return self.materialize().take(rows)


def select(records, rows: Sequence[int]):
    """The ``rows`` of a task's records, kept in order: a list of bytes, or Columns."""
    if isinstance(records, (Columns, ColumnStream)):
        return records.take(rows)
    return [records[k] for k in rows]


def concat(pieces: Sequence[Columns]) -> Columns:
    """The rows of ``pieces`` (of one layout) one after another."""
    merged = []
    for i, first in enumerate(pieces[0].columns):
        parts = [p.columns[i] for p in pieces]
        values = np.concatenate([c.values for c in parts])
        offsets = None
        if first.is_list:
            offsets, base = [np.zeros(1, np.int64)], 0
            for c in parts:
                offsets.append(c.offsets[1:] + base)
                base += int(c.offsets[-1])
            offsets = np.concatenate(offsets)
        merged.append(Column(first.name, values, offsets))
    return Columns(merged, sum(len(p) for p in pieces))


def from_arrow(table) -> Columns:
    """The Arrow ``table`` as Columns (structs flattened to ``parent.child``)."""
    table = flatten_structs(table)
    return Columns([_column(name, _one_array(table.column(name))) for name in table.column_names], table.num_rows)


def _one_array(chunked):
    """The column as one Arrow array: its only chunk as it is (``combine_chunks`` copies even one)."""
    return chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()


def _column(name: str, array) -> Column:
    import pyarrow as pa
    import pyarrow.compute as pc

    offsets = None
    values = array
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or pa.types.is_fixed_size_list(values.type):
        if pa.types.is_fixed_size_list(values.type):
            values = values.cast(pa.large_list(values.type.value_type))
        if values.null_count == 0:  # the common case: the list's own offsets, rebased to 0
            raw = values.offsets.to_numpy()
            inner = raw.astype(np.int64) - int(raw[0])
            flat = values.values.slice(int(raw[0]), int(raw[-1] - raw[0]))
        else:  # a null list is an empty one
            own = pc.fill_null(pc.list_value_length(values), 0).to_numpy().astype(np.int64)
            inner = np.zeros(len(own) + 1, np.int64)
            np.cumsum(own, out=inner[1:])
            flat = pc.list_flatten(values)
        offsets = inner if offsets is None else inner[offsets]  # an outer list's composed with the inner's
        values = flat
    kind = values.type
    if pa.types.is_dictionary(kind):
        values = values.dictionary_decode()
        kind = values.type
    if values.null_count:
        if offsets is None:
            row = int(np.flatnonzero(~values.is_valid().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"column {name!r} is null in row {row} (of the rows read): a scalar column read as columns "
                "(--data_reader_params records=columns) needs a value in every row. Fill the nulls when "
                "writing the files, or read Examples (records=examples), where a null is an empty feature."
            )
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        kept = np.zeros(len(valid) + 1, np.int64)
        np.cumsum(valid, out=kept[1:])
        offsets = kept[offsets]
        values = values.filter(pa.array(valid))
    if pa.types.is_floating(kind):
        data = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    elif pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_temporal(kind):
        if pa.types.is_temporal(kind):
            values = values.cast(pa.int32() if pa.types.is_date32(kind) else pa.int64())
        data = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        data = values.cast(pa.large_binary()).to_numpy(zero_copy_only=False)
    else:
        raise DataError(
            f"column {name!r} has type {array.type}, which has no tensor as a column: use integers, "
            "floating point numbers, strings or binary, lists of them, or structs of them"
        )
    return Column(name, data, offsets)

