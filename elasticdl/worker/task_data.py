"""A task's records as batches that know which records they came from.

The records are cut into chunks of ``batch_size`` *before* the model zoo's
``dataset_fn`` sees them, and ``dataset_fn`` runs on each chunk (inside one tf.data
pipeline, traced once). Each batch is tagged with its chunk index, so after any batch
the worker knows exactly which of the task's records are trained: a worker told to
leave reports that prefix, and the master requeues only the rest. A shuffle inside
``dataset_fn`` therefore mixes records within a batch; tasks themselves are reshuffled
every epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import tensorflow as tf

from elasticdl.mode import Mode
from elasticdl.model_spec import DatasetMetadata, ModelSpec, ModelSpecError


def chunked_batches(
    spec: ModelSpec,
    records: Sequence[bytes],
    mode: Mode,
    metadata: DatasetMetadata,
    batch_size: int,
) -> tf.data.Dataset:
    """(chunk index, batch) pairs; chunk i holds records [i * batch_size, (i + 1) * batch_size)."""
    raw = tf.data.Dataset.from_tensor_slices(tf.constant(list(records), dtype=tf.string))

    def per_chunk(index, chunk):
        dataset = spec.dataset_fn(tf.data.Dataset.from_tensor_slices(chunk), mode, metadata)
        if not isinstance(dataset, tf.data.Dataset):
            raise ModelSpecError(
                f"{spec.module_path}: dataset_fn must return a tf.data.Dataset. "
                f"Received: {type(dataset).__name__}"
            )
        return dataset.batch(batch_size).map(lambda *batch: (index, batch[0] if len(batch) == 1 else batch))

    return raw.batch(batch_size).enumerate().flat_map(per_chunk).prefetch(1)


def batches_with_progress(dataset: tf.data.Dataset, total: int, batch_size: int) -> Iterator[tuple[object, int]]:
    """Yield (batch, records done once this batch is trained).

    Looks one batch ahead: a chunk counts as done only when its last batch was trained,
    so an interrupted task never loses records, whatever ``dataset_fn`` does.
    """
    iterator = iter(dataset)
    current = next(iterator, None)
    done = 0
    while current is not None:
        following = next(iterator, None)
        index, batch = current
        if following is None or int(following[0]) != int(index):
            done = min((int(index) + 1) * batch_size, total)
        yield batch, done
        current = following
