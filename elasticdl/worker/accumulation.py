"""GradientAccumulator: the gradients of the batches a worker trained but has not pushed yet.

With ``--use_async --push_steps n`` a worker pushes once every n batches (the seed's "each
trainer uploads its accumulated gradient every n mini-batches"); in between it applies each
batch's gradients to its own copy of the model. The push carries the *mean* of the n
gradients (of the dense variables and the embedding rows): the gradient of one batch n times
larger, which the PS's optimizer applies as one step, as it applies the average of a sync
version's gradients; the learning rate keeps that meaning. The sum moved the shared model by
n steps' worth per push and was unstable on digits with momentum (docs/consistency.md). The
changes of non-trainable variables (BatchNorm statistics) are summed: they are what the n
steps did to the worker's copy, and the PS adds them.

The push names the position of the *last* batch (the PS's exactly-once mark moves to its
``records_end``) and the records of *all* of them (the PS's ``records_applied`` counts each
record once), so ps/data_position.py needs nothing new: a retried accumulated push is
recognised as taken, like a retried single batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.rpc.batch_position import BatchPosition


class GradientAccumulator:
    """Sums dense gradients and non-trainable changes, gathers embedding rows; pushes means.

    >>> acc = GradientAccumulator()
    >>> acc.add({"w": np.ones(2, np.float32)}, BatchPosition(7, 1, 132, 32))
    >>> acc.add({"w": np.full(2, 3, np.float32)}, BatchPosition(7, 1, 164, 32))
    >>> grads, position = acc.means()
    >>> grads["w"].tolist(), position, acc.batches
    ([2.0, 2.0], BatchPosition(task_id=7, handout=1, records_end=164, records=64), 2)
    """

    def __init__(self):
        self._grads: dict = {}
        self._position: BatchPosition | None = None
        self.batches = 0

    def add(self, grads: dict, position: BatchPosition | None) -> None:
        if self._position is not None and position is not None and (
            (position.task_id, position.handout) != (self._position.task_id, self._position.handout)
        ):
            raise ValueError(
                f"gradients of task {position.task_id} (hand-out {position.handout}) added to those of task "
                f"{self._position.task_id} (hand-out {self._position.handout}): push those first"
            )
        for name, grad in grads.items():
            held = self._grads.get(name)
            if held is None:
                self._grads[name] = _own_copy(grad)
            elif isinstance(grad, IndexedRows):
                self._grads[name] = IndexedRows(np.concatenate([held.ids, grad.ids]),
                                                np.concatenate([held.values, grad.values]))
            elif isinstance(grad, NonTrainableChange):
                np.add(held.values, grad.values, out=held.values)
            else:
                held += grad
        if position is not None:
            records = position.records + (self._position.records if self._position is not None else 0)
            self._position = dataclasses.replace(position, records=records)  # keeps the task's ticket
        self.batches += 1

    def means(self) -> tuple[dict, BatchPosition | None]:
        """What to push and the position it covers: the mean gradients, the summed non-trainable
        changes. The sums are kept until ``clear`` (a failed push is pushed again)."""
        self._grads = {name: g.deduplicated() if isinstance(g, IndexedRows) else g for name, g in self._grads.items()}
        n = np.float32(max(1, self.batches))
        out = {}
        for name, g in self._grads.items():
            if isinstance(g, IndexedRows):
                out[name] = IndexedRows(g.ids, g.values / n)
            elif isinstance(g, NonTrainableChange):
                out[name] = g
            else:
                out[name] = g / n
        return out, self._position

    def clear(self) -> None:
        """Pushed, or dropped (the task was taken back: another hand-out trains its records)."""
        self._grads = {}
        self._position = None
        self.batches = 0


def _own_copy(grad):
    # The first batch's arrays are read-only views of TensorFlow's tensors: sum into a copy.
    if isinstance(grad, IndexedRows):
        return IndexedRows(np.array(grad.ids), np.array(grad.values))
    if isinstance(grad, NonTrainableChange):
        return NonTrainableChange(np.array(grad.values))
    return np.array(grad)
