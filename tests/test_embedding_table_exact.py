"""The table's fast paths give bit-identical rows: against a per-id reference of the optimizer.

The reference keeps each id's row and slots in a dict and runs the optimizer on contiguous
copies of the batch's rows: what the table computes, with none of its machinery (the block
split into parts, positions remembered from a lookup, duplicates found by the index).
"""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.table import EmbeddingTable, IndexedRows, TableInfo, initial_rows
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer

UNIFORM = {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 3}
SPECS = {
    "sgd": OptimizerSpec("SGD", {"learning_rate": 0.1}),
    "momentum": OptimizerSpec("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "adam": OptimizerSpec("Adam", {"learning_rate": 0.01}),
    "amsgrad_clipnorm_decay": OptimizerSpec("Adam", {"learning_rate": 0.01, "amsgrad": True, "clipnorm": 0.5,
                                                     "weight_decay": 0.01}),
    "adagrad": OptimizerSpec("Adagrad", {"learning_rate": 0.1}),
    "rmsprop": OptimizerSpec("RMSprop", {"learning_rate": 0.01, "momentum": 0.5}),
}


class Reference:
    """Rows and slots per id, updated by the optimizer on contiguous copies of a batch."""

    def __init__(self, optimizer, dim: int) -> None:
        self.optimizer, self.dim = optimizer, dim
        self.rows: dict[int, np.ndarray] = {}
        self.slots: dict[int, dict[str, np.ndarray]] = {}

    def create(self, ids: np.ndarray) -> None:
        new = np.array([i for i in dict.fromkeys(ids.tolist()) if i not in self.rows], np.int64)
        for i, row in zip(new.tolist(), initial_rows(UNIFORM, new, self.dim)):
            self.rows[i] = row
            self.slots[i] = {k: v[0] for k, v in self.optimizer.create_slots(np.zeros((1, self.dim), np.float32)).items()}

    def apply(self, grads: IndexedRows, step: int) -> None:
        grads = grads.deduplicated()
        self.create(grads.ids)
        keys = grads.ids.tolist()
        param = np.stack([self.rows[i] for i in keys])
        slots = {name: np.stack([self.slots[i][name] for i in keys]) for name in self.optimizer.slot_names}
        self.optimizer.apply(param, grads.values, slots, step)
        for n, i in enumerate(keys):
            self.rows[i] = param[n]
            for name in slots:
                self.slots[i][name] = slots[name][n]

    def assert_equals(self, table: EmbeddingTable) -> None:
        ids, rows, slots = table.state()
        assert sorted(ids.tolist()) == sorted(self.rows)
        np.testing.assert_array_equal(rows, np.stack([self.rows[i] for i in ids.tolist()]))
        for name in self.optimizer.slot_names:
            np.testing.assert_array_equal(slots[name], np.stack([self.slots[i][name] for i in ids.tolist()]))


def batches(rng, vocab: int, size: int, count: int):
    """Unique ids in a random order (as tf.unique gives them), now and then with a duplicate."""
    for n in range(count):
        ids = rng.permutation(vocab)[:size].astype(np.int64)
        if n % 3 == 2:
            ids = np.concatenate([ids, ids[:2]])
        yield ids


@pytest.mark.parametrize("dim", [16, 3])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_lookup_then_update_is_bit_identical_to_the_optimizer_on_contiguous_rows(name, dim):
    optimizer = make_optimizer(SPECS[name])
    table = EmbeddingTable(TableInfo("t", dim, UNIFORM), optimizer)
    reference = Reference(optimizer, dim)
    rng = np.random.default_rng(7)
    for step, ids in enumerate(batches(rng, 3000, 700, 12), start=1):
        values = rng.normal(size=(ids.size, dim)).astype(np.float32)
        if step % 4:  # the worker's order: a lookup of the ids, then their gradients
            looked_up = table.lookup(ids, create=True)
            reference.create(ids)
            np.testing.assert_array_equal(looked_up, np.stack([reference.rows[i] for i in ids.tolist()]))
        table.apply(IndexedRows(ids, values), step, None)  # repeated ids: the table sums them
        reference.apply(IndexedRows(ids, values), step)
        reference.assert_equals(table)


def test_remembered_positions_are_dropped_when_rows_are_evicted():
    """A lookup's positions serve the push of the same ids only while no row left: an evicted
    row's position is reused by another id, whose row the push must not touch."""
    optimizer = make_optimizer(SPECS["sgd"])
    table = EmbeddingTable(TableInfo("t", 4, UNIFORM, TablePolicy(max_rows=100)), optimizer)
    first = np.arange(100, dtype=np.int64)
    table.lookup(first, create=True)
    others = np.arange(1000, 1100, dtype=np.int64)
    before = table.lookup(others, create=True)  # evicts every row of `first`; their places reused
    assert len(table) == 100 and 0 not in table._index
    table.apply(IndexedRows(first, np.ones((100, 4), np.float32)), 1, None)  # new rows again
    ids, rows, _ = table.state()
    assert sorted(ids.tolist()) == first.tolist()  # the cap evicted `others` in turn
    np.testing.assert_array_equal(rows[np.argsort(ids)], initial_rows(UNIFORM, first, 4) - np.float32(0.1))
    assert not np.array_equal(before, rows)
