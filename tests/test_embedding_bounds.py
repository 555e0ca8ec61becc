"""Bounded embedding tables (numpy, no TensorFlow): admission, ttl, max_rows, resume from checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.model.embedding import admission
from elasticdl.model.embedding import table as table_module
from elasticdl.model.embedding.policy import TableCounters, TablePolicy
from elasticdl.model.embedding.table import EmbeddingError, EmbeddingTable, IndexedRows, TableInfo
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.server import ParameterServer, PSSettings

TABLE = "emb/embeddings"
DIM = 4
UNIFORM = {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 11}


def sgd():
    return make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1}))


def adam():
    return make_optimizer(OptimizerSpec("Adam", {"learning_rate": 0.01}))


def make_table(optimizer=None, **policy) -> EmbeddingTable:
    return EmbeddingTable(TableInfo(TABLE, DIM, UNIFORM, TablePolicy(**policy)), optimizer or sgd())


def grads(ids, value=1.0) -> IndexedRows:
    ids = np.asarray(ids, np.int64)
    return IndexedRows(ids, np.full((ids.size, DIM), value, np.float32))


class Shard:
    """Applies to one table the way ParameterShard does: one step and one version per apply."""

    def __init__(self, table: EmbeddingTable):
        self.table, self.step = table, 0

    def push(self, ids, value=1.0) -> None:
        self.step += 1
        self.table.apply(grads(ids, value), self.step, None, self.table.version + 1)
        self.table.advance(self.table.version + 1)


def held(table: EmbeddingTable) -> set[int]:
    return set(table.state()[0].tolist())


# ---------------------------------------------------------------- max_rows


def test_rows_stay_under_max_rows_for_an_endless_stream_of_new_ids():
    table = make_table(max_rows=100)
    shard = Shard(table)
    for batch in range(200):
        shard.push(np.arange(batch * 64, (batch + 1) * 64))
        assert len(table) <= 100 and len(table._index) == len(table)
    # The least recently updated went first: the last 100 ids trained are the ones held.
    assert held(table) == set(range(200 * 64 - 100, 200 * 64))
    assert table.counters == TableCounters(admissions=200 * 64, evictions_max_rows=200 * 64 - 100)
    # Memory is bounded too, not only the count: positions are reused and the log is compacted.
    assert table._size <= 100 + 64 and table._rows.shape[0] <= max(table_module._INITIAL_CAPACITY, 2 * (100 + 64))
    assert len(table._log) <= 2 * 100 + 64


def test_a_row_updated_again_is_kept_and_the_oldest_is_evicted():
    table = make_table(max_rows=3)
    shard = Shard(table)
    for ids in ([1], [2], [3], [1], [4]):  # 1 was updated after 2 and 3: 2 goes first
        shard.push(ids)
    assert held(table) == {1, 3, 4}


def test_an_evicted_id_that_comes_back_starts_as_a_new_row():
    table = make_table(max_rows=1)
    shard = Shard(table)
    shard.push([7], value=5.0)
    trained = table.lookup(np.array([7]), create=False).copy()
    shard.push([8])
    assert held(table) == {8}
    np.testing.assert_array_equal(table.lookup(np.array([7]), create=False), np.zeros((1, DIM)))
    fresh = table.lookup(np.array([7]), create=True)  # a training lookup makes it anew
    np.testing.assert_array_equal(fresh, table_module.initial_rows(UNIFORM, np.array([7]), DIM))
    assert not np.array_equal(fresh, trained)


def test_the_recency_log_stays_small_when_the_same_rows_are_updated_forever():
    table = make_table(max_rows=50)
    shard = Shard(table)
    for _ in range(2000):
        shard.push(np.arange(10))
    assert len(table) == 10 and table._log._pos.size == 1024  # compacted, never grown


# ---------------------------------------------------------------- ttl


def test_rows_not_updated_for_ttl_versions_are_expired():
    table = make_table(ttl_versions=3)
    shard = Shard(table)
    shard.push([1, 2])  # version 1
    shard.push([2])  # version 2
    shard.push([9])  # version 3
    assert held(table) == {1, 2, 9}
    shard.push([9])  # version 4: 1 was last updated at 1 = 4 - 3
    assert held(table) == {2, 9}
    shard.push([9])  # version 5
    assert held(table) == {9}
    assert table.counters.evictions_ttl == 2


def test_expiry_is_lazy_on_reads_when_the_background_budget_ran_out(monkeypatch):
    monkeypatch.setattr(table_module, "EXPIRE_BUDGET", 0)  # advance() looks at nothing
    table = make_table(ttl_versions=2)
    shard = Shard(table)
    shard.push([1])
    shard.push([2])
    shard.push([2])
    assert 1 in table._index  # not swept yet...
    np.testing.assert_array_equal(table.lookup(np.array([1, 2]), create=False)[0], np.zeros(DIM))
    assert 1 not in table._index and table.counters.evictions_ttl == 1  # ...but never read


def test_expiry_does_a_bounded_amount_of_work_per_version(monkeypatch):
    monkeypatch.setattr(table_module, "EXPIRE_BUDGET", 100)
    table = make_table(ttl_versions=1)
    shard = Shard(table)
    shard.push(np.arange(1000))
    shard.push([5000])  # all 1000 are expired now; one advance evicts at most 100 of them
    assert 900 <= len(table) - 1 <= 1000 - 1 and table.counters.evictions_ttl <= 100
    for _ in range(12):
        shard.push([5000])
    assert held(table) == {5000}


# ---------------------------------------------------------------- admission


def test_an_id_gets_a_row_at_its_admit_min_count_th_sighting():
    table = make_table(admit_min_count=3)
    shard = Shard(table)
    assert not table.lookup(np.array([4]), create=True).any()  # lookups never create: the zero row
    shard.push([4], value=1.0)
    shard.push([4], value=1.0)
    assert held(table) == set() and table.counters.dropped_gradients == 2
    shard.push([4], value=1.0)  # the third sighting: a row, and this gradient is applied
    expected = table_module.initial_rows(UNIFORM, np.array([4]), DIM) - 0.1
    np.testing.assert_allclose(table.lookup(np.array([4]), create=False), expected, rtol=1e-6)
    assert table.counters == TableCounters(admissions=1, dropped_gradients=2)


def test_admission_by_chance_is_per_sighting_and_the_same_on_every_replica():
    def admitted(order) -> set[int]:
        table = make_table(admit_probability=0.25)
        for step, ids in enumerate(order, start=1):
            table.apply(grads(ids), step, None, step)
        return held(table)

    ids = np.arange(20_000)
    rng = np.random.default_rng(0)
    first = admitted([ids])
    assert 0.23 < len(first) / ids.size < 0.27
    # Another replica gets the same ids at the same step in another order: the same decisions.
    assert admitted([rng.permutation(ids)]) == first
    # An id refused once may be admitted at a later sighting (a fresh draw per step).
    second = admitted([ids, ids])
    assert first < second and 0.40 < len(second) / ids.size < 0.47


def test_admission_counts_live_in_a_fixed_size_sketch():
    table = make_table(admit_min_count=2)
    shard = Shard(table)
    sketch = table._admission.sketch
    for batch in range(50):
        shard.push(np.arange(batch * 10_000, (batch + 1) * 10_000))  # 500,000 ids seen once
    assert table._admission.sketch is sketch and sketch.nbytes == 4 << 20
    # Collisions can only admit early: a few ids seen once got a row, most did not.
    assert table.counters.dropped_gradients > 0.95 * 500_000
    assert len(table) == table.counters.admissions == 500_000 - table.counters.dropped_gradients


def test_the_sketch_forgets_old_sightings(monkeypatch):
    monkeypatch.setattr(admission, "HALVING_PERIOD", 4)
    table = make_table(admit_min_count=2)
    shard = Shard(table)
    shard.push([1])
    shard.push([2, 3, 4])  # the 4th sighting: every count is halved, 1's single sighting is gone
    shard.push([1])
    assert held(table) == set()
    shard.push([1])  # two sightings since the halving
    assert held(table) == {1}


def test_admission_and_eviction_together_bound_the_table():
    table = make_table(admit_min_count=2, max_rows=50, ttl_versions=20)
    shard = Shard(table)
    rng = np.random.default_rng(3)
    for _ in range(300):
        shard.push(np.unique(rng.zipf(1.3, size=200) % 100_000))
        assert len(table) <= 50
    c = table.counters
    assert c.admissions - c.evictions_ttl - c.evictions_max_rows == len(table) and c.dropped_gradients > 0


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"admit_min_count": 0}, "`admit_min_count` must be an integer >= 1 and <= 65535. Received: admit_min_count=0"),
        ({"admit_min_count": 70000}, "`admit_min_count` must be an integer >= 1 and <= 65535"),
        ({"ttl_versions": 1 << 63}, "`ttl_versions` must be an integer >= 0 and <= 4611686018427387904"),
        ({"admit_probability": 0.0}, "`admit_probability` must be a number in (0, 1]"),
        ({"admit_probability": 1.5}, "`admit_probability` must be a number in (0, 1]"),
        ({"ttl_versions": -1}, "`ttl_versions` must be an integer >= 0"),
        ({"max_rows": 2.5}, "`max_rows` must be an integer >= 0"),
    ],
)
def test_bad_policies_are_refused_with_the_argument_named(setting, message):
    with pytest.raises(ValueError) as err:
        TablePolicy(**setting)
    assert message in str(err.value)


def test_the_policy_travels_in_the_table_info_json():
    info = TableInfo(TABLE, DIM, UNIFORM, TablePolicy(admit_min_count=3, max_rows=10))
    back = TableInfo.from_json(TABLE, DIM, info.to_json())
    assert back == info and TableInfo.from_json(TABLE, DIM, TableInfo(TABLE, DIM, UNIFORM).to_json()).policy == TablePolicy()
    with pytest.raises(EmbeddingError, match="max_rows"):
        TableInfo.from_json(TABLE, DIM, '{"distribution": "constant", "value": 0, "seed": 0, "policy": {"max_rows": -2}}')


def test_a_resumed_job_with_another_policy_bounds_the_restored_table():
    table = make_table()
    Shard(table).push(np.arange(100))
    table.set_policy(TablePolicy(max_rows=30))
    assert len(table) == 30 and held(table) == set(range(70, 100))


# ---------------------------------------------------------------- checkpoints


POLICY = TablePolicy(admit_min_count=2, ttl_versions=6, max_rows=40)


def bounded_ps(tmp_path, ps_id=0, num_ps=1, init="") -> ParameterServer:
    settings = PSSettings(ps_id=ps_id, num_ps=num_ps, use_async=True, checkpoint_dir=str(tmp_path / "ckpt"),
                          checkpoint_dir_for_init=init)
    ps = ParameterServer(settings, adam())
    ps.restore()
    ps.push_model({"dense/bias": np.zeros(2, np.float32)} if ps_id == 0 else {})
    ps.push_embedding_table_infos([TableInfo(TABLE, DIM, UNIFORM, POLICY)])
    return ps


def stream(seed: int, steps: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(rng.zipf(1.5, size=64) % 500).astype(np.int64)
        yield IndexedRows(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))


def push(servers, grad: IndexedRows) -> None:
    n = len(servers)
    for ps in servers:
        ps.push_gradients({TABLE: grad.select(grad.ids % n == ps.settings.ps_id)}, ps.shard.version, None)


def snapshot(ps: ParameterServer):
    table = ps.shard.embeddings[TABLE]
    ids, rows, slots, touched, meta = table.saved()
    return ids.tolist(), rows.tolist(), {k: v.tolist() for k, v in slots.items()}, touched.tolist(), \
        {k: v.tolist() for k, v in meta.items()}, table.counters


def test_a_restored_bounded_table_goes_on_exactly_as_the_original(tmp_path):
    original = bounded_ps(tmp_path)
    for grad in stream(0, 40):
        push([original], grad)
    path = original.save_checkpoint()
    restored = bounded_ps(tmp_path, init=path)
    assert snapshot(restored) == snapshot(original)
    assert restored.shard.embeddings[TABLE].policy == POLICY
    for grad in stream(1, 40):  # the same updates from here: the same admissions and evictions
        push([original], grad)
        push([restored], grad)
        assert snapshot(restored) == snapshot(original)
    counters = original.shard.embeddings[TABLE].counters
    assert counters.dropped_gradients and counters.evictions_max_rows and counters.evictions_ttl


def test_re_sharding_keeps_the_job_totals_and_the_sightings(tmp_path):
    old = [bounded_ps(tmp_path, ps_id, 2) for ps_id in range(2)]
    for grad in stream(0, 30):
        push(old, grad)
    paths = {ps.save_checkpoint() for ps in old}
    (path,) = paths
    new = [bounded_ps(tmp_path / "new", ps_id, 3, init=path) for ps_id in range(3)]
    total = [sum(ps.shard.embeddings[TABLE].counters.as_list()[i] for ps in servers) for servers in (old, new)
             for i in range(4)]
    assert total[:4] == total[4:]  # counters on the new PS 0, none counted twice
    old_rows = sum(len(ps.shard.embeddings[TABLE]) for ps in old)
    assert 0 < sum(len(ps.shard.embeddings[TABLE]) for ps in new) <= old_rows
    for ps in new:  # each new PS counted every sighting it could be asked about
        assert ps.shard.embeddings[TABLE]._admission.sketch.sum() == sum(
            o.shard.embeddings[TABLE]._admission.sketch.sum() for o in old)


# ---------------------------------------------------------------- report and TensorBoard


def test_table_counters_reach_the_report_and_tensorboard_summed_over_the_ps(tmp_path):
    from elasticdl.master import embedding_stats
    from elasticdl.proto import elasticdl_pb2
    from elasticdl.ps.servicer import PServerServicer
    from elasticdl.rpc.ps_commands import stats_of

    servers = [bounded_ps(tmp_path, ps_id, 2) for ps_id in range(2)]
    for grad in stream(0, 30):
        push(servers, grad)
    answers = [stats_of(PServerServicer(ps).get_stats(elasticdl_pb2.Empty(), None)) for ps in servers]
    tables = embedding_stats.summarize_tables(answers)
    expected = {key: sum(ps.shard.embeddings[TABLE].stats().as_dict()[key] for ps in servers)
                for key in ("rows", "bytes", "admissions", "dropped_gradients", "evictions_ttl", "evictions_max_rows")}
    assert tables == {TABLE: expected} and expected["rows"] <= 2 * POLICY.max_rows and expected["dropped_gradients"]

    class Board:
        def scalars(self, step, values, prefix=""):
            self.written = (step, values)

    board = Board()
    embedding_stats.report(answers, board, epoch=0)
    assert board.written == (30, {f"embedding/{TABLE}/{k}": float(v) for k, v in expected.items()})


def test_exports_and_evaluation_snapshots_hold_live_rows_only(tmp_path):
    ps = bounded_ps(tmp_path)
    for grad in stream(0, 40):
        push([ps], grad)
    table = ps.shard.embeddings[TABLE]
    live = set(table._index)
    ids, rows = ps.embedding_table(TABLE)
    assert set(ids.tolist()) == live and len(ids) == len(live) <= POLICY.max_rows and rows.shape == (len(ids), DIM)
    evicted = np.array(sorted(set(range(500)) - live)[:5], np.int64)
    assert evicted.size
    ps.take_snapshot(7)
    np.testing.assert_array_equal(ps.lookup_embeddings(TABLE, evicted, False, snapshot_id=7), 0)
    kept = np.array(sorted(live)[:5], np.int64)
    np.testing.assert_array_equal(ps.lookup_embeddings(TABLE, kept, False, snapshot_id=7),
                                  ps.lookup_embeddings(TABLE, kept, False))
