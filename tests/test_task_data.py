"""BatchStream: one pipeline for task after task, with exact per-record accounting."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from elasticdl.mode import Mode
from elasticdl.model.spec import DatasetMetadata, ModelSpec, ModelSpecError
from elasticdl.worker.task_data import BatchStream

CSV = DatasetMetadata("csv")


def _spec(dataset_fn) -> ModelSpec:
    return ModelSpec("zoo/m.py", "custom_model", None, None, None, dataset_fn)


def _parse(dataset, mode, metadata):
    """Records are numbers as text; the label is the number itself."""
    def parse(line):
        x = tf.strings.to_number(line, tf.float32)
        return (tf.reshape(x, [1]), x) if mode != Mode.PREDICTION else tf.reshape(x, [1])
    return dataset.map(parse)


def _records(start: int, stop: int) -> list[bytes]:
    return [str(i).encode() for i in range(start, stop)]


def _drain(stream, records):
    return [(np.asarray(batch[1]).tolist(), done) for batch, done in stream.batches(records)]


def test_tasks_share_one_pipeline_and_report_exact_progress():
    stream = BatchStream(_spec(_parse), Mode.TRAINING, CSV, batch_size=4)
    first = _drain(stream, _records(0, 10))
    assert first == [([0, 1, 2, 3], 4), ([4, 5, 6, 7], 8), ([8, 9], 10)]
    iterator = stream._iterator
    second = _drain(stream, _records(100, 105))
    assert second == [([100, 101, 102, 103], 4), ([104], 5)]
    assert stream._iterator is iterator  # no new pipeline for the second task
    assert stream._one_batch_per_chunk  # a map-only dataset_fn: one element per batch, no markers
    assert _drain(stream, []) == []


def test_a_chunk_counts_only_when_its_last_batch_is_out():
    def twice(dataset, mode, metadata):  # every record twice: two batches per chunk
        return _parse(dataset, mode, metadata).flat_map(
            lambda x, y: tf.data.Dataset.from_tensors((x, y)).repeat(2))

    stream = BatchStream(_spec(twice), Mode.TRAINING, CSV, batch_size=2)
    assert _drain(stream, _records(0, 4)) == [([0, 0], 0), ([1, 1], 2), ([2, 2], 2), ([3, 3], 4)]
    assert not stream._one_batch_per_chunk  # two examples per record: end-of-chunk markers


def test_filtered_chunks_yield_nothing_and_do_not_block():
    def odd_only(dataset, mode, metadata):
        return _parse(dataset, mode, metadata).filter(lambda x, y: tf.math.floormod(y, 2) == 1)

    stream = BatchStream(_spec(odd_only), Mode.TRAINING, CSV, batch_size=2)
    # Chunk [4, 6) is dropped entirely by the filter; [6, 7) too (it is even).
    assert _drain(stream, [b"1", b"3", b"4", b"6", b"8", b"9", b"6"]) == [([1, 3], 2), ([9], 6)]
    assert _drain(stream, _records(0, 2)) == [([1], 2)]


def test_a_task_left_early_never_leaks_into_the_next():
    stream = BatchStream(_spec(_parse), Mode.TRAINING, CSV, batch_size=2)
    batches = stream.batches(_records(0, 8))
    batch, done = next(batches)
    assert done == 2
    batches.close()  # the worker was told to leave, or the batch failed
    assert _drain(stream, _records(50, 53)) == [([50, 51], 2), ([52], 3)]


def test_prediction_mode_features_only():
    stream = BatchStream(_spec(_parse), Mode.PREDICTION, CSV, batch_size=3)
    out = [(np.asarray(batch).ravel().tolist(), done) for batch, done in stream.batches(_records(0, 4))]
    assert out == [([0, 1, 2], 3), ([3], 4)]


def test_dataset_fn_must_return_a_dataset():
    stream = BatchStream(_spec(lambda dataset, mode, metadata: [1, 2]), Mode.TRAINING, CSV, batch_size=2)
    with pytest.raises(ModelSpecError, match="dataset_fn must return a tf.data.Dataset"):
        _drain(stream, _records(0, 2))


def test_ragged_and_sparse_features_are_batched_too():
    def ragged(dataset, mode, metadata):  # ids for an embedding with a combiner
        return dataset.map(lambda line: (
            {"ragged": tf.strings.to_number(tf.strings.split([line], ","), tf.int64),  # [1, None]
             "sparse": tf.sparse.from_dense(tf.strings.to_number(tf.strings.split(line, ","), tf.int64))},
            1.0,
        ))

    stream = BatchStream(_spec(ragged), Mode.TRAINING, CSV, batch_size=2)
    out = list(stream.batches([b"1,2", b"3", b"4,5,6"]))
    assert [done for _, done in out] == [2, 3]
    features, _ = out[0][0]
    assert features["ragged"].to_list() == [[[1, 2]], [[3]]]
    assert tf.sparse.to_dense(features["sparse"]).numpy().tolist() == [[1, 2], [3, 0]]


def test_a_record_the_parse_refuses_fails_its_task_only():
    stream = BatchStream(_spec(_parse), Mode.TRAINING, CSV, batch_size=2)
    assert _drain(stream, _records(0, 2)) == [([0, 1], 2)]
    with pytest.raises(tf.errors.InvalidArgumentError, match="StringToNumber"):
        _drain(stream, [b"3", b"not a number", b"5"])  # the error reaches the worker's thread
    assert _drain(stream, _records(7, 10)) == [([7, 8], 2), ([9], 3)]


def test_closing_a_stream_whose_reader_waits_for_the_next_task():
    stream = BatchStream(_spec(_parse), Mode.TRAINING, CSV, batch_size=2)
    assert _drain(stream, _records(0, 3)) == [([0, 1], 2), ([2], 3)]
    reader = stream._reader
    stream.close()  # the reader thread was waiting for chunks that will never come
    reader._thread.join(5)
    assert not reader._thread.is_alive()
    assert _drain(stream, _records(4, 6)) == [([4, 5], 2)]
