"""How an embedding table stores its rows: one block of rows and slots, the id index, the memory
a row costs, and gradient rows summed per id (model/embedding/table.py, rows.py)."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.model.embedding.table import EmbeddingError, EmbeddingTable, IndexedRows, TableInfo
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer

INIT = {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 3}


def optimizer(name: str = "Adam", **config):
    return make_optimizer(OptimizerSpec.from_json_dict({"name": name, "config": {"learning_rate": 0.01, **config}}))


def test_duplicate_gradient_rows_are_summed_per_id_as_add_at_does():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, 400).astype(np.int64)
    values = rng.standard_normal((400, 4)).astype(np.float32)
    unique, inverse = np.unique(ids, return_inverse=True)
    expected = np.zeros((unique.size, 4), np.float32)
    np.add.at(expected, inverse, values)
    got = IndexedRows(ids, values).deduplicated()
    np.testing.assert_array_equal(got.ids, unique)
    np.testing.assert_allclose(got.values, expected, rtol=1e-5, atol=1e-6)  # float32 sums, maybe in another order
    rows = IndexedRows(np.array([3, 1, 2], np.int64), values[:3])
    assert rows.deduplicated() is rows  # unique ids: nothing copied


@pytest.mark.parametrize("name, config, slots", [("SGD", {}, 0), ("SGD", {"momentum": 0.9}, 1),
                                                 ("Adagrad", {}, 1), ("Adam", {}, 2)])
def test_rows_and_slots_share_one_block_and_start_from_the_optimizers_values(name, config, slots):
    opt = optimizer(name, **config)
    table = EmbeddingTable(TableInfo("t", 4, INIT), opt)
    assert table._rows.shape[1] == 4 * (1 + slots)
    table.lookup(np.array([9, 2, 9], np.int64), create=True)  # an id twice: one row
    assert len(table) == 2
    ids, rows, got = table.state()
    np.testing.assert_array_equal(ids, [2, 9])  # made in id order
    assert got.keys() == opt.create_slots(rows).keys()
    for slot, value in opt.create_slots(rows).items():
        np.testing.assert_array_equal(got[slot], value)
    # An update through the block equals the optimizer on the gathered rows and slots.
    grad = np.full((2, 4), 0.5, np.float32)
    expected_rows, expected_slots = rows.copy(), {k: v.copy() for k, v in got.items()}
    opt.apply(expected_rows, grad, expected_slots, 1, None)
    table.apply(IndexedRows(ids, grad), 1, None)
    _, rows, got = table.state()
    np.testing.assert_array_equal(rows, expected_rows)
    for slot, value in expected_slots.items():
        np.testing.assert_array_equal(got[slot], value)


def test_a_row_costs_close_to_its_physical_size():
    """width x 4 x (1 + slots) + the id: the index adds 8 to 16 bytes, the last-update version 8."""
    table = EmbeddingTable(TableInfo("t", 16, INIT), optimizer("Adam"))
    rows = 100_000
    for start in range(0, rows, 8192):
        table.lookup(np.arange(start, min(start + 8192, rows), dtype=np.int64) * 7, create=True)
    physical = 16 * 4 * 3 + 8
    per_row = table.nbytes / rows
    assert physical < per_row <= 1.3 * physical
    assert table._index.nbytes / rows <= 16 + 1


def test_a_snapshot_keeps_its_rows_while_the_table_changes():
    table = EmbeddingTable(TableInfo("t", 4, INIT), optimizer())
    ids = np.arange(10, dtype=np.int64)
    before = table.lookup(ids, create=True)
    frozen = table.frozen()
    table.apply(IndexedRows(ids, np.ones((10, 4), np.float32)), 1, None)
    table.lookup(np.arange(10, 5000, dtype=np.int64), create=True)  # grows the block and the index
    np.testing.assert_array_equal(frozen.lookup(ids), before)
    np.testing.assert_array_equal(frozen.lookup(np.array([4000], np.int64)), np.zeros((1, 4)))


def test_a_table_past_what_the_index_addresses_is_refused_naming_the_flags(monkeypatch):
    from elasticdl.model.embedding import id_index

    monkeypatch.setattr(id_index, "MAX_POSITIONS", 3000)  # really 2**31 - 1: int32 slots
    table = EmbeddingTable(TableInfo("t", 4, INIT), optimizer())
    table.lookup(np.arange(2048, dtype=np.int64), create=True)
    with pytest.raises(EmbeddingError, match="--embedding_max_rows.*--num_ps"):
        table.lookup(np.arange(2048, 4096, dtype=np.int64), create=True)
    assert len(table) == 2048  # the refused batch made no row


def test_a_ps_holding_a_table_grows_by_its_rows_not_by_their_outgrown_copies():
    """A PS keeps freed heap memory (launch/api.py's ROLE_ENV): a table that grew through the heap
    kept every outgrown copy of its arrays resident, 1.9x its rows (the dict-based table)."""
    import json
    import subprocess
    import sys

    from benchmarks.common import REPO, child_env

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.embedding_memory", "--rss", json.dumps({"rows": 300_000, "batch": 8192})],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RSS_RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RSS_RESULT "):])
    assert result["physical_bytes_per_row"] == 16 * 4 * 3 + 8
    assert result["rss_bytes_per_row"] <= 1.3 * result["physical_bytes_per_row"], result
