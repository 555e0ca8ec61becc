"""Embedding tables on the PS (numpy, no TensorFlow): lazy rows, slots, sync, checkpoints, bad input."""

from __future__ import annotations

import copy

import grpc
import numpy as np
import pytest

from elasticdl.model.embedding.table import (
    EmbeddingError,
    EmbeddingTable,
    IndexedRows,
    TableInfo,
    initial_rows,
)
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.ps_client import PSClient

TABLE = "emb/embeddings"
DIM = 4
UNIFORM = {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 11}
INFO = TableInfo(TABLE, DIM, UNIFORM)


def adam():
    return make_optimizer(OptimizerSpec("Adam", {"learning_rate": 0.01}))


def make_ps(optimizer=None, ps_id=0, num_ps=1, **settings) -> ParameterServer:
    ps = ParameterServer(PSSettings(ps_id=ps_id, num_ps=num_ps, **settings), optimizer or adam())
    ps.push_model({"dense/bias": np.zeros(2, np.float32)} if ps_id == 0 else {})
    ps.push_embedding_table_infos([INFO])
    return ps


def rows(ids, value=1.0, dim=DIM) -> IndexedRows:
    ids = np.asarray(ids, np.int64)
    return IndexedRows(ids, np.full((ids.size, dim), value, np.float32))


def table_state(ps: ParameterServer):
    """A deep copy of everything a push or lookup may change."""
    shard = ps.shard
    tables = {n: t.state() for n, t in shard.embeddings.items()}
    return copy.deepcopy((shard.params, shard.slots, shard.version, shard.step, tables))


def assert_same(a, b):
    pa, sa, va, ta, tables_a = a
    pb, sb, vb, tb, tables_b = b
    assert (va, ta) == (vb, tb)
    assert tables_a.keys() == tables_b.keys()
    for name in tables_a:
        ids_a, rows_a, slots_a = tables_a[name]
        ids_b, rows_b, slots_b = tables_b[name]
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(rows_a, rows_b)
        for slot in slots_a:
            np.testing.assert_array_equal(slots_a[slot], slots_b[slot])
    for name in pa:
        np.testing.assert_array_equal(pa[name], pb[name])


# ---------------------------------------------------------------- initial rows


@pytest.mark.parametrize(
    "spec",
    [
        UNIFORM,
        {"distribution": "normal", "mean": 0.5, "stddev": 0.1, "seed": 3},
        {"distribution": "truncated_normal", "mean": 0.0, "stddev": 1.0, "seed": 3},
        {"distribution": "constant", "value": 0.25, "seed": 0},
    ],
    ids=lambda s: s["distribution"],
)
def test_initial_rows_depend_only_on_seed_id_and_column(spec):
    ids = np.arange(20_000, dtype=np.int64)
    full = initial_rows(spec, ids, 8)
    assert full.dtype == np.float32 and full.shape == (20_000, 8)
    # The same id gives the same row in any batch, in any order.
    picked = np.array([19_999, 5, 5, 12_345, 0], np.int64)
    np.testing.assert_array_equal(initial_rows(spec, picked, 8), full[picked])
    # A narrower table's row is the prefix of a wider one's: columns are independent draws.
    np.testing.assert_array_equal(initial_rows(spec, picked, 3), full[picked, :3])
    kind = spec["distribution"]
    if kind == "uniform":
        assert full.min() >= -0.05 and full.max() < 0.05
        assert abs(full.mean()) < 1e-3 and abs(full.std() - 0.1 / np.sqrt(12)) < 1e-3
    elif kind == "normal":
        assert abs(full.mean() - 0.5) < 3e-3 and abs(full.std() - 0.1) < 3e-3
    elif kind == "truncated_normal":
        assert np.abs(full).max() <= 2.0 and abs(full.std() - 0.88) < 0.02
    else:
        assert np.all(full == 0.25)
    if kind != "constant":
        other = initial_rows({**spec, "seed": spec["seed"] + 1}, ids, 8)
        assert np.mean(other == full) < 0.01  # another seed, other values
        assert len(np.unique(full[:, 0])) > 19_000  # no repeating pattern over ids


def test_lookup_creates_rows_lazily_only_when_training():
    table = EmbeddingTable(INFO, adam())
    assert len(table) == 0
    np.testing.assert_array_equal(table.lookup(np.array([7, 3], np.int64), create=False), 0)
    assert len(table) == 0  # evaluation lookups never create rows
    first = table.lookup(np.array([7, 3, 7], np.int64), create=True)
    assert len(table) == 2
    np.testing.assert_array_equal(first, initial_rows(UNIFORM, np.array([7, 3, 7]), DIM))
    np.testing.assert_array_equal(table.lookup(np.array([3], np.int64), create=False), first[1:2])
    # Fresh slots of created rows: Adam's start at zero.
    _, _, slots = table.state()
    assert set(slots) == {"momentum", "velocity"} and not np.any(slots["momentum"])


def test_table_grows_past_its_first_block_and_keeps_every_row():
    table = EmbeddingTable(INFO, make_optimizer(OptimizerSpec("Adagrad", {"initial_accumulator_value": 0.3})))
    ids = np.random.default_rng(0).permutation(5000).astype(np.int64)
    for chunk in np.array_split(ids, 7):
        table.lookup(chunk, create=True)
    assert len(table) == 5000
    state_ids, state_rows, slots = table.state()
    np.testing.assert_array_equal(np.sort(state_ids), np.arange(5000))
    np.testing.assert_array_equal(state_rows, initial_rows(UNIFORM, state_ids, DIM))
    np.testing.assert_array_equal(slots["accumulator"], np.float32(0.3))


# ---------------------------------------------------------------- updates


def dense_reference(optimizer, start: np.ndarray, steps: list[IndexedRows]) -> np.ndarray:
    """The same optimizer on the whole table as one dense variable (zero rows where no gradient)."""
    param = start.copy()
    slots = optimizer.create_slots(param)
    for step, grad in enumerate(steps, start=1):
        dense = np.zeros_like(param)
        np.add.at(dense, grad.ids, grad.values)
        optimizer.apply(param, dense, slots, step)
    return param


@pytest.mark.parametrize(
    "spec, lazy",
    [
        (OptimizerSpec("SGD", {"learning_rate": 0.1}), False),
        (OptimizerSpec("Adagrad", {"learning_rate": 0.1}), False),
        (OptimizerSpec("SGD", {"learning_rate": 0.1, "momentum": 0.9}), True),
        (OptimizerSpec("Adam", {"learning_rate": 0.01}), True),
        (OptimizerSpec("RMSprop", {"learning_rate": 0.01}), True),
    ],
    ids=["sgd", "adagrad", "momentum", "adam", "rmsprop"],
)
def test_row_updates_equal_the_optimizer_on_a_dense_table(spec, lazy):
    """Rows with a gradient at every step match the dense update; for lazy optimizers the rest
    are only updated at steps where they had a gradient (docs/embeddings.md)."""
    rng = np.random.default_rng(0)
    vocab = 30
    always = np.array([0, 1, 2], np.int64)
    steps = []
    for _ in range(6):
        ids = np.concatenate([always, rng.integers(3, vocab, 5), always[:1]])  # duplicates too
        steps.append(IndexedRows(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32)))
    ps = make_ps(make_optimizer(spec), use_async=True)
    ps.lookup_embeddings(TABLE, np.arange(vocab, dtype=np.int64), create=True)
    start = ps.lookup_embeddings(TABLE, np.arange(vocab, dtype=np.int64), create=False)
    for grad in steps:
        assert ps.push_gradients({TABLE: grad}, ps.shard.version, None).applied
    actual = ps.lookup_embeddings(TABLE, np.arange(vocab, dtype=np.int64), create=False)
    expected = dense_reference(make_optimizer(spec), start, steps)
    compared = always if lazy else np.arange(vocab)
    np.testing.assert_allclose(actual[compared], expected[compared], atol=1e-5)
    assert not np.allclose(actual[always], start[always])
    untouched = np.setdiff1d(np.arange(vocab), np.concatenate([g.ids for g in steps]))
    np.testing.assert_array_equal(actual[untouched], start[untouched])


def test_sync_sums_rows_per_id_then_averages_like_dense_gradients():
    sgd = make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.5}))
    ps = make_ps(sgd, grads_to_wait=2)
    start = ps.lookup_embeddings(TABLE, np.arange(4, dtype=np.int64), create=True)
    first = IndexedRows(np.array([0, 1], np.int64), np.array([[1.0] * DIM, [2.0] * DIM], np.float32))
    second = IndexedRows(np.array([1, 3], np.int64), np.array([[4.0] * DIM, [8.0] * DIM], np.float32))
    assert not ps.push_gradients({TABLE: first}, 0, None).applied
    np.testing.assert_array_equal(ps.lookup_embeddings(TABLE, np.arange(4, dtype=np.int64), False), start)
    assert ps.push_gradients({TABLE: second}, 0, None).applied
    # Per id: (sum over the pushes) / 2 pushes, the average a dense table's rows would get.
    expected = start - 0.5 * np.array([[0.5], [3.0], [0.0], [4.0]], np.float32)
    np.testing.assert_allclose(ps.lookup_embeddings(TABLE, np.arange(4, dtype=np.int64), False), expected, rtol=1e-6)


def test_gradients_for_rows_never_looked_up_create_them_first():
    sgd = make_optimizer(OptimizerSpec("SGD", {"learning_rate": 1.0}))
    ps = make_ps(sgd, use_async=True)
    ps.push_gradients({TABLE: rows([42], 0.5)}, 0, None)
    np.testing.assert_allclose(
        ps.lookup_embeddings(TABLE, np.array([42], np.int64), False), initial_rows(UNIFORM, [42], DIM) - 0.5
    )


def test_snapshot_lookups_read_the_frozen_rows():
    sgd = make_optimizer(OptimizerSpec("SGD", {"learning_rate": 1.0}))
    ps = make_ps(sgd, use_async=True)
    before = ps.lookup_embeddings(TABLE, np.array([1, 2], np.int64), create=True)
    ps.take_snapshot(5)
    ps.push_gradients({TABLE: rows([1, 9], 1.0)}, 0, None)
    np.testing.assert_array_equal(ps.lookup_embeddings(TABLE, np.array([1, 2, 9], np.int64), False, 5),
                                  np.concatenate([before, np.zeros((1, DIM), np.float32)]))
    np.testing.assert_allclose(ps.lookup_embeddings(TABLE, np.array([1], np.int64), False), before[:1] - 1)
    ps.drop_snapshot(5)
    with pytest.raises(KeyError):
        ps.lookup_embeddings(TABLE, np.array([1], np.int64), False, 5)


def test_table_infos_are_idempotent_and_a_changed_width_is_refused():
    ps = make_ps()
    ps.lookup_embeddings(TABLE, np.array([1], np.int64), create=True)
    ps.push_embedding_table_infos([INFO, TableInfo("other/embeddings", 2, UNIFORM)])
    assert len(ps.shard.embeddings[TABLE]) == 1  # kept its rows
    with pytest.raises(EmbeddingError, match="width 4 on the parameter server, the model's layer has 8"):
        ps.push_embedding_table_infos([TableInfo(TABLE, 8, UNIFORM)])


# ---------------------------------------------------------------- bad input

BAD_LOOKUPS = {
    "float ids": (TABLE, np.array([1.0, 2.0]), "must be int64"),
    "int32 ids": (TABLE, np.array([1, 2], np.int32), "must be int64"),
    "negative ids": (TABLE, np.array([4, -2], np.int64), "must be non-negative"),
    "2-D ids": (TABLE, np.array([[2, 4]], np.int64), "must be 1-D"),
    "another PS's id": (TABLE, np.array([2, 3], np.int64), "id 3 of embedding table 'emb/embeddings' belongs to PS 1"),
    "unknown table": ("nope/embeddings", np.array([2], np.int64), "unknown embedding table 'nope/embeddings'"),
}

BAD_PUSHES = {
    "wrong row width": (TABLE, rows([2, 4], dim=DIM + 1), "must have shape (2, 4)"),
    "one row per id": (TABLE, IndexedRows(np.array([2, 4], np.int64), np.ones((3, DIM), np.float32)), "must have shape (2, 4)"),
    "float ids": (TABLE, IndexedRows(np.array([2.0]), np.ones((1, DIM), np.float32)), "must be int64"),
    "negative ids": (TABLE, rows([2, -4]), "must be non-negative"),
    "another PS's id": (TABLE, rows([2, 5]), "belongs to PS 1"),
    "unknown table": ("nope/embeddings", rows([2]), "unknown embedding table 'nope/embeddings'"),
    "int rows": (TABLE, IndexedRows(np.array([2], np.int64), np.ones((1, DIM), np.int64)), "must be float"),
    "nan rows": (TABLE, rows([2], np.nan), "NaN or Inf"),
}


def two_ps_shard(**settings) -> ParameterServer:
    """PS 0 of 2 with rows 0, 2, 4 trained once (non-zero slots)."""
    ps = make_ps(ps_id=0, num_ps=2, **settings)
    ps.lookup_embeddings(TABLE, np.array([0, 2, 4], np.int64), create=True)
    ps.push_gradients({TABLE: rows([0, 2]), "dense/bias": np.ones(2, np.float32)}, 0, None)
    return ps


@pytest.mark.parametrize("kind", sorted(BAD_LOOKUPS))
def test_bad_lookups_are_refused_and_change_nothing(kind):
    ps = two_ps_shard(use_async=True)
    before = table_state(ps)
    name, ids, message = BAD_LOOKUPS[kind]
    with pytest.raises(EmbeddingError) as err:
        ps.lookup_embeddings(name, ids, create=True)
    assert message in str(err.value)
    assert_same(table_state(ps), before)


@pytest.mark.parametrize("use_async", [True, False])
@pytest.mark.parametrize("kind", sorted(BAD_PUSHES))
def test_bad_row_gradients_are_refused_and_change_nothing(kind, use_async):
    ps = two_ps_shard(use_async=use_async, grads_to_wait=1 if use_async else 2)  # sync: one pending
    before = table_state(ps)
    name, bad, message = BAD_PUSHES[kind]
    with pytest.raises(EmbeddingError) as err:
        # A good dense gradient alongside must not be applied either.
        ps.push_gradients({"dense/bias": np.ones(2, np.float32), name: bad}, ps.shard.version, None)
    assert message in str(err.value)
    assert_same(table_state(ps), before)
    assert ps.stats()[1].pushes_rejected_invalid == 1
    if not use_async:  # the pending gradient still waits for exactly one more
        ps.push_gradients({TABLE: rows([4])}, ps.shard.version, None)
        assert ps.shard.version == before[2] + 1


@pytest.fixture
def grpc_two_ps():
    cores = [two_ps_shard(use_async=True)]
    second = make_ps(ps_id=1, num_ps=2, use_async=True)
    cores.append(second)
    servers, addresses = [], []
    for core in cores:
        server = grpc_utils.make_server(max_workers=4)
        grpc_utils.add_service(server, "PServer", PServerServicer(core))
        addresses.append(f"127.0.0.1:{grpc_utils.bind_local(server, 0)}")
        server.start()
        servers.append(server)
    channel = grpc_utils.make_channel(addresses[0])
    try:
        yield cores, elasticdl_pb2_grpc.PServerStub(channel), addresses
    finally:
        channel.close()
        for server in servers:
            server.stop(grace=None)


@pytest.mark.parametrize("kind", sorted(BAD_LOOKUPS))
def test_grpc_bad_lookups_are_invalid_argument(grpc_two_ps, kind):
    cores, stub, _ = grpc_two_ps
    before = table_state(cores[0])
    name, ids, message = BAD_LOOKUPS[kind]
    request = elasticdl_pb2.PullEmbeddingVectorsRequest(name=name, ids=tensor_codec.encode("ids", ids), create=True)
    with pytest.raises(grpc.RpcError) as err:
        stub.pull_embedding_vectors(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert_same(table_state(cores[0]), before)


@pytest.mark.parametrize("kind", sorted(BAD_PUSHES))
def test_grpc_bad_row_gradients_are_invalid_argument(grpc_two_ps, kind):
    cores, stub, _ = grpc_two_ps
    before = table_state(cores[0])
    name, bad, message = BAD_PUSHES[kind]
    request = elasticdl_pb2.PushGradientsRequest(
        worker_id=0, version=cores[0].shard.version,
        gradients=[tensor_codec.encode("dense/bias", np.ones(2, np.float32))],
        embedding_gradients=[elasticdl_pb2.IndexedRows(
            name=name, ids=tensor_codec.encode("ids", bad.ids), values=tensor_codec.encode("values", bad.values)
        )],
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.push_gradients(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert_same(table_state(cores[0]), before)


def test_grpc_malformed_ids_and_bad_table_infos_are_invalid_argument(grpc_two_ps):
    cores, stub, _ = grpc_two_ps
    before = table_state(cores[0])
    short = elasticdl_pb2.Tensor(name="ids", dtype="int64", shape=[2], content=b"\0" * 9)
    with pytest.raises(grpc.RpcError) as err:
        stub.pull_embedding_vectors(elasticdl_pb2.PullEmbeddingVectorsRequest(name=TABLE, ids=short), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs 16 bytes" in err.value.details()
    for bad in (
        elasticdl_pb2.EmbeddingTableInfo(name=TABLE, dim=DIM + 1, initializer=INFO.to_json()),
        elasticdl_pb2.EmbeddingTableInfo(name="x", dim=0, initializer=INFO.to_json()),
        elasticdl_pb2.EmbeddingTableInfo(name="x", dim=2, initializer='{"distribution": "glorot"}'),
        elasticdl_pb2.EmbeddingTableInfo(name="x", dim=2, initializer="not json"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.push_embedding_table_infos(elasticdl_pb2.EmbeddingTableInfos(tables=[bad]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_same(table_state(cores[0]), before)


def test_client_lookups_route_ids_and_tables_stream_back_whole(grpc_two_ps, monkeypatch):
    from elasticdl.ps import servicer

    cores, _, addresses = grpc_two_ps
    client = PSClient(addresses)
    try:
        ids = np.array([5, 0, 2, 7, 9, 4, 11], np.int64)
        looked_up = client.lookup(TABLE, ids, create=True)
        assert [c.shard.embeddings[TABLE].state()[0].tolist() for c in cores] == [[0, 2, 4], [5, 7, 9, 11]]
        np.testing.assert_array_equal(looked_up[[0, 3, 4, 6]], initial_rows(UNIFORM, ids[[0, 3, 4, 6]], DIM))
        np.testing.assert_array_equal(looked_up[[1, 2, 5]], cores[0].lookup_embeddings(TABLE, ids[[1, 2, 5]], False))
        # Streamed in chunks of 3 rows: every row once, equal to a lookup.
        cores[1].shard.embeddings[TABLE].lookup(np.arange(1, 2001, 2, dtype=np.int64), create=True)
        monkeypatch.setattr(servicer, "TABLE_CHUNK_BYTES", 3 * (DIM * 4 + 8))
        stub = elasticdl_pb2_grpc.PServerStub(client._channels[1])
        chunks = list(stub.pull_embedding_table(elasticdl_pb2.PullEmbeddingTableRequest(name=TABLE)))
        assert len(chunks) == 334 and all(len(tensor_codec.decode(c.ids)) <= 3 for c in chunks)
        all_ids, all_rows = client.pull_embedding_table(TABLE)
        assert sorted(all_ids.tolist()) == sorted([0, 2, 4] + list(range(1, 2001, 2)))
        np.testing.assert_array_equal(all_rows, client.lookup(TABLE, all_ids, create=False))
        with pytest.raises(EmbeddingError, match="must be non-negative"):
            client.lookup(TABLE, np.array([-1], np.int64), create=True)
    finally:
        client.close()


# ---------------------------------------------------------------- checkpoints


def trained_shards(tmp_path, num_ps: int = 2) -> list[ParameterServer]:
    servers = []
    rng = np.random.default_rng(1)
    ids = np.arange(40, dtype=np.int64)
    grads = [IndexedRows(ids, rng.normal(size=(40, DIM)).astype(np.float32)) for _ in range(3)]
    for ps_id in range(num_ps):
        ps = make_ps(ps_id=ps_id, num_ps=num_ps, use_async=True, checkpoint_dir=str(tmp_path / "ckpt"))
        for grad in grads:
            ps.push_gradients({TABLE: grad.select(grad.ids % num_ps == ps_id)}, ps.shard.version, None)
        servers.append(ps)
    return servers


def merged_rows(servers) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    ids, rows, slots = [], [], {}
    for ps in servers:
        i, r, s = ps.shard.embeddings[TABLE].state()
        assert np.all(i % len(servers) == ps.settings.ps_id)
        ids.append(i)
        rows.append(r)
        for k, v in s.items():
            slots.setdefault(k, []).append(v)
    ids = np.concatenate(ids)
    order = np.argsort(ids)
    return ids[order], np.concatenate(rows)[order], {k: np.concatenate(v)[order] for k, v in slots.items()}


@pytest.mark.parametrize("new_num_ps", [1, 2, 3])
def test_checkpoint_holds_rows_and_slots_and_restores_onto_any_number_of_ps(tmp_path, new_num_ps):
    old = trained_shards(tmp_path)
    assert {ps.save_checkpoint() for ps in old} == {f"{tmp_path / 'ckpt'}/version-3"}
    old_ids, old_rows, old_slots = merged_rows(old)
    assert old_ids.tolist() == list(range(40)) and np.any(old_slots["velocity"])

    restored = []
    for ps_id in range(new_num_ps):
        ps = ParameterServer(
            PSSettings(ps_id=ps_id, num_ps=new_num_ps, use_async=True, checkpoint_dir_for_init=str(tmp_path / "ckpt")),
            adam(),
        )
        ps.restore()
        assert ps.shard.embeddings[TABLE].info == INFO and ps.shard.step == 3
        restored.append(ps)
    new_ids, new_rows, new_slots = merged_rows(restored)  # asserts each row is on its id's PS
    np.testing.assert_array_equal(new_ids, old_ids)
    np.testing.assert_array_equal(new_rows, old_rows)
    for slot in ("momentum", "velocity"):
        np.testing.assert_array_equal(new_slots[slot], old_slots[slot])

    # Training continues as it would have without the restart.
    grad = IndexedRows(np.arange(50, dtype=np.int64), np.full((50, DIM), 0.3, np.float32))
    for group in (old, restored):
        for ps in group:
            n = len(group)
            ps.push_gradients({TABLE: grad.select(grad.ids % n == ps.settings.ps_id)}, 3, None)
    a, b = merged_rows(old), merged_rows(restored)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
