"""A task's records as batches that know which records they came from.

The records are cut into chunks of ``batch_size`` *before* the model zoo's
``dataset_fn`` sees them, and ``dataset_fn`` runs on each chunk. Each batch is tagged
with its chunk index, and every chunk ends with an empty end-of-chunk marker, so after
any batch the worker knows exactly which of the task's records are trained: a worker
told to leave reports that prefix, and the master requeues only the rest. A shuffle
inside ``dataset_fn`` therefore mixes records within a batch; tasks themselves are
reshuffled every epoch.

One pipeline serves every task of a worker: building a tf.data pipeline traces
``dataset_fn`` and instantiates an iterator, which took longer than training a whole
digits task (145 ms against 26 ms per 512-record task when fed through a long-lived
iterator). Tasks are fed to the running pipeline through a TensorFlow queue instead.

Most ``dataset_fn``s map each record to one example (a probe on three placeholder records
tells, without running the parse). For them a chunk yields exactly one batch, so each
batch arrives already marked as its chunk's last: one pipeline element per batch and no
markers, which halves the per-batch cost of reading the pipeline (it is Python-bound at
about 0.7 ms an element; a small model's whole step takes a few ms). A reader thread then
takes each batch while the worker waits for the parameter servers.

Parquet Columns (``records=columns``, elasticdl/data/columns.py) go the same way: a chunk
is enqueued as the numpy arrays of its columns (values, and row offsets of a list column),
and the pipeline turns them into a dict of column tensors per row (a list column's row a
1-D tensor) before ``dataset_fn``. The queue's dtypes follow the columns, so the pipeline is
built for the first task's columns and serves every task of the same columns.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence

import tensorflow as tf

from elasticdl.data.columns import Columns, ColumnStream
from elasticdl.mode import Mode
from elasticdl.model.spec import DatasetMetadata, ModelSpec
from elasticdl.model.trainer import column_dtypes, column_tensors, user_dataset

_QUEUE_CAPACITY = 1 << 20  # chunks; a task has far fewer
_RETIRED_QUEUES: list = []  # see BatchStream.close


class BatchStream:
    """The batches of task after task, from one long-lived ``dataset_fn`` pipeline."""

    def __init__(self, spec: ModelSpec, mode: Mode, metadata: DatasetMetadata, batch_size: int):
        self.spec = spec
        self.mode = mode
        self.metadata = metadata
        self.batch_size = batch_size
        self._chunks: tf.queue.FIFOQueue | None = None
        self._iterator = None
        self._reader: _Reader | None = None  # only when each chunk is one batch
        self._layout: tuple | None = None  # Columns.layout the pipeline is fed; None: bytes records

    @property
    def _one_batch_per_chunk(self) -> bool:
        return self._reader is not None

    def batches(self, records: Sequence[bytes] | Columns | ColumnStream) -> Iterator[tuple[object, int]]:
        """Yield (batch, records of this task done once this batch is trained).

        A task left early (an exception, or a worker told to leave) leaves batches in the
        pipeline; the pipeline is then rebuilt for the next task, so no task ever sees
        another's records.
        """
        n_chunks = math.ceil(len(records) / self.batch_size)
        if not n_chunks:
            return
        layout = records.layout if isinstance(records, (Columns, ColumnStream)) else None
        if self._iterator is not None and layout != self._layout:
            self.close()  # other column types than the pipeline was built for (not within one data set)
        if self._iterator is None:
            self._open(layout)
        fed = 0
        if layout is None:
            for i in range(n_chunks):
                chunk = list(records[i * self.batch_size:(i + 1) * self.batch_size])
                self._chunks.enqueue((tf.constant(i, tf.int64), tf.constant(chunk, tf.string)))
            fed = n_chunks
        else:
            chunks = enumerate(records.chunks(self.batch_size))

            def feed(fed: int, upto: int) -> int:
                """Enqueue chunks ``fed`` .. ``upto`` - 1 (a streamed chunk waits for its rows); the
                chunks fed after."""
                while fed < min(upto, n_chunks):
                    i, components = next(chunks)
                    self._chunks.enqueue([tf.constant(i, tf.int64), *components])
                    fed = i + 1
                return fed

            # A stream is fed two chunks ahead of training (its later row groups arrive meanwhile);
            # with end-of-chunk markers, or Columns all there, every chunk at once.
            streamed = isinstance(records, ColumnStream) and self._one_batch_per_chunk
            fed = feed(0, 2 if streamed else n_chunks)
        complete = False
        try:
            if self._one_batch_per_chunk:
                for i in range(n_chunks):
                    if fed < n_chunks:
                        fed = feed(fed, i + 2)
                    index, batch = self._reader.next()
                    if index != i:  # cannot happen unless the pipeline breaks its contract
                        raise RuntimeError(f"the input pipeline skipped chunk {i} (got {index})")
                    yield batch, min((i + 1) * self.batch_size, len(records))
                complete = True
                return
            # Look one element ahead: a batch completes its chunk when the chunk's marker follows it.
            current = next(self._iterator)
            while True:
                index, is_marker, batch = int(current[0]), bool(current[1]), current[2]
                if is_marker and index == n_chunks - 1:
                    complete = True
                    return
                following = next(self._iterator)
                if not is_marker:
                    chunk_done = bool(following[1]) and int(following[0]) == index
                    yield batch.get_value(), min((index + 1) * self.batch_size, len(records)) if chunk_done else (
                        index * self.batch_size)
                current = following
        finally:
            if not complete:
                self.close()

    def close(self) -> None:
        if self._chunks is None:
            return
        # The pipeline's thread may be waiting in a dequeue: closing the queue ends that wait,
        # and the queue itself is kept (it is tiny once empty) because TensorFlow frees a
        # queue under a dequeue still unwinding, which crashes the process.
        self._chunks.close(cancel_pending_enqueues=True)
        _RETIRED_QUEUES.append(self._chunks)
        if self._reader is not None:
            self._reader.stop()  # it ends once the closed queue fails its wait
        self._iterator = None
        self._reader = None
        self._chunks = None
        self._layout = None

    def __del__(self):
        self.close()

    def _open(self, layout: tuple | None) -> None:
        # A TensorFlow queue, not a Python generator: the pipeline's thread then waits for the
        # next task without the GIL, and a dropped pipeline never deadlocks the interpreter.
        # A chunk of Columns travels as its numpy components (values, and offsets of a list column).
        dtypes = [tf.string] if layout is None else column_dtypes(layout)
        self._chunks = tf.queue.FIFOQueue(_QUEUE_CAPACITY, [tf.int64, *dtypes])
        self._layout = layout
        one_batch_per_chunk = _one_example_per_record(self.spec, self.mode, self.metadata, layout)
        pipeline = _pipeline(self._chunks, self.spec, self.mode, self.metadata, self.batch_size,
                             one_batch_per_chunk, layout)
        self._iterator = iter(pipeline)
        if one_batch_per_chunk:
            self._reader = _Reader(self._iterator)


class _Reader:
    """Takes the pipeline's elements in a thread of its own, one ahead of the worker.

    Taking an element costs about 0.7 ms of Python (TensorFlow's structure handling);
    the thread does it while the worker's own thread waits for the parameter servers.
    """

    def __init__(self, iterator):
        self._iterator = iterator
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="input-reader", daemon=True)
        self._thread.start()

    def next(self) -> tuple[int, object]:
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self._stopped = True
        try:  # make room, in case the thread waits to hand over an element
            self._ready.get_nowait()
        except queue.Empty:
            pass

    def _run(self) -> None:
        while not self._stopped:
            try:
                index, batch = next(self._iterator)
                item = (int(index), batch)
            except BaseException as err:  # the pipeline failed, or its queue was closed
                item = err
            if self._stopped:
                return
            self._ready.put(item)
            if isinstance(item, BaseException):
                return


def _one_example_per_record(spec: ModelSpec, mode: Mode, metadata: DatasetMetadata, layout: tuple | None) -> bool:
    """Does ``dataset_fn`` keep one element per record (maps only, no filter, flat_map or take)?"""
    if layout is None:
        raw = tf.data.Dataset.from_tensor_slices(tf.constant(["", "", ""]))
    else:  # three rows of zeros and empty lists
        components = []
        for _name, kind, is_list in layout:
            components.append(tf.zeros([0 if is_list else 3], tf.string if kind == "string" else kind))
            if is_list:
                components.append(tf.zeros([4], tf.int64))
        raw = tf.data.Dataset.from_tensor_slices(column_tensors(layout, components))
    probe = _user_dataset(spec, raw, mode, metadata)
    return int(probe.cardinality()) == 3


def _user_dataset(spec: ModelSpec, records: tf.data.Dataset, mode: Mode, metadata: DatasetMetadata):
    return user_dataset(spec, records, mode, metadata)  # with class weights, as the preflight's


def _pipeline(
    chunks: tf.queue.FIFOQueue,
    spec: ModelSpec,
    mode: Mode,
    metadata: DatasetMetadata,
    batch_size: int,
    one_batch_per_chunk: bool,
    layout: tuple | None = None,
) -> tf.data.Dataset:
    """Endless: each chunk dequeued goes through ``dataset_fn``.

    With ``one_batch_per_chunk`` elements are (chunk index, batch). Otherwise each chunk's
    batches are followed by an end-of-chunk marker: (chunk index, False, batch) ..., then
    (chunk index, True, no batch). A plain function, not a method: the traced pipeline must
    not keep the stream alive.
    """

    def next_chunk(_):
        index, *components = chunks.dequeue()
        index.set_shape([])
        for component in components:
            component.set_shape([None])
        return index, tuple(components)

    @tf.autograph.experimental.do_not_convert  # plain Python: errors reach the user unwrapped
    def chunk_batches(index, components) -> tf.data.Dataset:
        raw = (tf.data.Dataset.from_tensor_slices(components[0]) if layout is None
               else tf.data.Dataset.from_tensor_slices(column_tensors(layout, components)))
        dataset = _user_dataset(spec, raw, mode, metadata)
        batches = dataset.batch(batch_size).map(lambda *b: b[0] if len(b) == 1 else b)
        if one_batch_per_chunk:
            return batches.map(lambda *b: (index, b[0] if len(b) == 1 else b))
        # Optional values: the marker carries an empty one, whatever the batch holds
        # (dense, ragged or sparse tensors).
        marker = tf.experimental.Optional.empty(batches.element_spec)
        return batches.map(lambda *b: (index, False, tf.experimental.Optional.from_value(b[0] if len(b) == 1 else b))).concatenate(
            tf.data.Dataset.from_tensors((index, True, marker)))

    return tf.data.Dataset.from_tensors(0).repeat().map(next_chunk).flat_map(chunk_batches).prefetch(1)
