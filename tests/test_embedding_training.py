"""PS-backed embeddings in training: workers over real gRPC against in-process PS, vs. Keras."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl.layers import Embedding
from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.export import export_saved_model
from elasticdl.model.optimizers import make_optimizer, optimizer_spec_from_keras
from elasticdl.model.spec import load_model_spec
from elasticdl.model.trainer import Trainer
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc.channel import add_service, bind_local, make_server
from elasticdl.rpc.ps_client import PSClient
from elasticdl.worker.worker import Worker

ZOO = os.path.join(os.path.dirname(__file__), "zoo")
TABLE = "emb/embeddings"


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(ZOO, "embzoo.tiny_ctr.custom_model")


@contextlib.contextmanager
def parameter_servers(keras_optimizer, num_ps: int = 2, **settings):
    """``num_ps`` PS cores behind real gRPC servers in this process; yields (cores, addresses)."""
    optimizer_spec = optimizer_spec_from_keras(keras_optimizer)
    cores, servers, addresses = [], [], []
    for ps_id in range(num_ps):
        core = ParameterServer(PSSettings(ps_id=ps_id, num_ps=num_ps, **settings), make_optimizer(optimizer_spec))
        server = make_server(max_workers=8)
        add_service(server, "PServer", PServerServicer(core))
        addresses.append(f"127.0.0.1:{bind_local(server)}")
        server.start()
        cores.append(core)
        servers.append(server)
    try:
        yield cores, addresses
    finally:
        for server in servers:
            server.stop(0)


def table_rows(cores, ids) -> np.ndarray:
    """The PS rows of ``ids`` (each from the PS holding it), without creating any."""
    ids = np.asarray(ids, np.int64)
    out = np.zeros((ids.size, cores[0].shard.embeddings[TABLE].dim), np.float32)
    for core in cores:
        mine = ids % len(cores) == core.settings.ps_id
        out[mine] = core.lookup_embeddings(TABLE, ids[mine], create=False)
    return out


def batches(seed: int, steps: int, batch: int = 8, vocab: int = 50, every_step: int = 0):
    """Random ids with duplicates; with ``every_step`` = k, ids 0..k-1 only, each in every batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if every_step:
            ids = np.concatenate([np.arange(every_step), rng.integers(0, every_step, batch * 3 - every_step)])
            ids = rng.permutation(ids).reshape(batch, 3)
        else:
            ids = rng.integers(0, vocab, size=(batch, 3))
            ids[1, 0] = ids[2, 0]  # a duplicate id within the batch
        out.append((ids.astype(np.int64), rng.normal(size=(batch, 1)).astype(np.float32)))
    return out


def reference_training(spec, initial_dense, data, keras_optimizer, steps):
    """Single process: the same model with a local table, Keras applying the averaged gradient."""
    model = spec.build_model({})  # outside a Trainer: a local table, initialised as the PS does
    assert model.get_layer("emb").mode == "local"
    variables = {v.path: v for v in model.trainable_variables}
    for name, value in initial_dense.items():
        variables[name].assign(value)
    for step in range(steps):
        grads = []
        for worker_data in data:
            features, labels = worker_data[step]
            with tf.GradientTape() as tape:
                loss = spec.loss(tf.constant(labels), model(tf.constant(features), training=True))
            grads.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, list(variables.values()))])
        averaged = [(g0 + g1) / 2 for g0, g1 in zip(*grads)]
        keras_optimizer.apply_gradients(zip(averaged, variables.values()))
    return {n: v.numpy() for n, v in variables.items()}


@pytest.mark.parametrize(
    "make_optimizer_, every_step",
    [
        (lambda: keras.optimizers.SGD(learning_rate=0.1), 0),
        (lambda: keras.optimizers.Adagrad(learning_rate=0.1), 0),
        (lambda: keras.optimizers.Adam(learning_rate=0.01), 10),
        (lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), 10),
    ],
    ids=["sgd", "adagrad", "adam", "momentum"],
)
def test_sync_two_workers_two_ps_equal_single_process_keras(spec, make_optimizer_, every_step):
    """grads_to_wait=2: each version averages both workers' row gradients per id, like dense ones.

    SGD and Adagrad leave a row without a gradient unchanged, so any ids will do. Adam and
    momentum move a dense table's rows even at steps without a gradient; the PS updates only
    the pushed rows (lazy). They agree when each row gets a gradient at every step or never:
    every batch then holds each of the ids 0..9 (and no other id).
    """
    steps = 4
    data = [batches(seed, steps, every_step=every_step) for seed in (1, 2)]
    with parameter_servers(make_optimizer_(), num_ps=2, grads_to_wait=2) as (cores, addresses):
        workers = [
            Worker(i, spec, Trainer(spec, {}), master=None, ps=PSClient(addresses), minibatch_size=8)
            for i in range(2)
        ]
        workers[0].trainer.ensure_built(tf.constant(data[0][0][0]))
        workers[0]._initialize_ps()
        initial_dense = {}
        for core in cores:
            initial_dense.update({k: v.copy() for k, v in core.shard.params.items()})
        assert set(initial_dense) == {"hidden/kernel", "hidden/bias", "out/kernel", "out/bias"}

        def run(worker, worker_data):
            for features, labels in worker_data:
                worker.train_batch(tf.constant(features), tf.constant(labels))

        threads = [threading.Thread(target=run, args=(w, d)) for w, d in zip(workers, data)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [core.shard.version for core in cores] == [steps, steps]
        # Rows live by id % 2; no PS holds an id of the other.
        for core in cores:
            ids, _, _ = core.shard.embeddings[TABLE].state()
            assert ids.size and np.all(ids % 2 == core.settings.ps_id)
        distributed = {}
        for core in cores:
            distributed.update({k: v.copy() for k, v in core.shard.params.items()})
        seen = np.unique(np.concatenate([b[0].ravel() for d in data for b in d]))
        ps_rows = table_rows(cores, seen)

    reference = reference_training(spec, initial_dense, data, make_optimizer_(), steps)
    for name, value in distributed.items():
        np.testing.assert_allclose(value, reference[name], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(ps_rows, reference[TABLE][seen], atol=1e-5)
    assert not np.allclose(ps_rows, spec.build_model({}).get_layer("emb").embeddings.numpy()[seen])


def test_row_gradients_are_deduplicated_and_equal_the_dense_gradient(spec):
    """Duplicates within a lookup and across two calls of one layer become one summed row per id."""
    shared = Trainer(spec, {"kind": "shared"})
    features = tf.constant([[3, 3, 7], [7, 9, 3]], tf.int64)
    labels = tf.constant([[1.0], [0.0]])
    shared.ensure_built(features)
    _, grads = shared.compute_gradients(features, labels)
    rows = grads[TABLE]
    assert isinstance(rows, IndexedRows)
    assert sorted(rows.ids.tolist()) == [3, 7, 9]  # unique

    local = spec.build_model({"kind": "shared"})
    for var in local.trainable_variables:
        if var.path != TABLE:
            var.assign(shared.variables[var.path])
    with tf.GradientTape() as tape:
        loss = spec.loss(labels, local(features, training=True))
    table = local.get_layer("emb").embeddings
    np.testing.assert_allclose(table.numpy()[[3, 7, 9]], shared.embeddings.source.tables[TABLE].lookup(
        np.array([3, 7, 9]), False))
    dense = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
    np.testing.assert_allclose(rows.values, dense[rows.ids], atol=1e-6)
    assert np.count_nonzero(np.abs(dense).sum(axis=1)) == 3


def test_train_step_is_traced_once_for_batches_of_different_ids(spec):
    trainer = Trainer(spec, {})
    rng = np.random.default_rng(0)
    trainer.ensure_built(tf.constant(rng.integers(0, 50, (4, 3))))
    for batch in (4, 4, 7, 9, 4):
        trainer.compute_gradients(tf.constant(rng.integers(0, 50, (batch, 3))), tf.zeros((batch, 1)))
    assert trainer._train_step.experimental_get_tracing_count() <= 2  # the first shape, then generalised


@pytest.mark.parametrize("kind, table", [("elasticdl", TABLE), ("subclassed", "sub_ctr/emb/embeddings")])
def test_export_materialises_tables_and_predicts_like_the_ps(spec, tmp_path, kind, table):
    """The serving model needs no PS, predicts what the PS-backed model predicts, and maps an
    id never trained to a zero row."""
    data = batches(3, 3, vocab=40)
    with parameter_servers(keras.optimizers.Adam(learning_rate=0.05), num_ps=2, use_async=True) as (cores, addresses):
        client = PSClient(addresses)
        worker = Worker(0, spec, Trainer(spec, {"kind": kind}), master=None, ps=client, minibatch_size=8)
        for features, labels in data:
            worker.train_batch(tf.constant(features), tf.constant(labels))
        worker._pull()
        trained = np.concatenate([b[0] for b in data])
        unseen = np.array([[45, 46, 1]], np.int64)  # 45 and 46 never trained
        distributed = worker.trainer.model(tf.constant(trained), training=False).numpy()
        serving = worker.trainer.serving_model(client.pull_embedding_table)
        rows_before = sum(len(c.shard.embeddings[table]) for c in cores)
        ids_on_ps = np.concatenate([c.shard.embeddings[table].state()[0] for c in cores])
        distributed_unseen = worker.trainer.model(tf.constant(unseen), training=False).numpy()
        assert sum(len(c.shard.embeddings[table]) for c in cores) == rows_before  # no row created
        client.close()

    layer = serving.emb if kind == "subclassed" else serving.get_layer("emb")
    assert layer.mode == "frozen"
    assert sorted(layer.ids.numpy()[:-1].tolist()) == sorted(ids_on_ps.tolist())
    np.testing.assert_allclose(serving(tf.constant(trained)).numpy(), distributed, atol=1e-6)
    np.testing.assert_array_equal(layer._rows(tf.constant([45, 46, -5, 2**62], tf.int64), False).numpy(), 0)
    np.testing.assert_allclose(serving(tf.constant(unseen)).numpy(), distributed_unseen, atol=1e-6)

    path = export_saved_model(serving, str(tmp_path / "model"))
    serving_fn = tf.saved_model.load(path).signatures["serving_default"]
    argument = list(serving_fn.structured_input_signature[1])[0]
    served = list(serving_fn(**{argument: tf.constant(trained)}).values())[0].numpy()
    np.testing.assert_allclose(served, distributed, atol=1e-6)


def test_large_keras_embeddings_are_swapped_and_logged(spec, caplog):
    with caplog.at_level(logging.INFO, logger="elasticdl.model.embedding.swap"):
        big = Trainer(spec, {"kind": "keras", "vocab": 200_000, "dim": 4})  # 3.1 MiB > 2 MiB
    layer = big.model.get_layer("emb")
    assert isinstance(layer, Embedding) and layer.mode == "ps" and layer.input_dim == 200_000
    assert "swapped for elasticdl.layers.Embedding 'emb'" in caplog.text
    assert "emb/embeddings" not in {v.path for v in big.model.weights}  # no 3 MiB table in this process

    small = Trainer(spec, {"kind": "keras", "vocab": 1000, "dim": 4})
    assert type(small.model.get_layer("emb")) is keras.layers.Embedding
    never = Trainer(spec, {"kind": "keras", "vocab": 200_000, "dim": 4}, embedding_swap_threshold_mb=-1)
    assert type(never.model.get_layer("emb")) is keras.layers.Embedding
    always = Trainer(spec, {"kind": "keras", "vocab": 10, "dim": 4}, embedding_swap_threshold_mb=0)
    assert isinstance(always.model.get_layer("emb"), Embedding)
    # Outside a Trainer nothing is swapped.
    assert type(spec.build_model({"kind": "keras", "vocab": 200_000, "dim": 4}).get_layer("emb")) is keras.layers.Embedding


def test_swap_covers_subclassed_models_and_keeps_unsupported_layers(caplog):
    from elasticdl.model.embedding.backends import EmbeddingTables, use_embedding_backend
    from elasticdl.model.embedding.swap import swap_large_embeddings

    class Ranker(keras.Model):
        def __init__(self):
            super().__init__(name="ranker")
            self.items = keras.layers.Embedding(100_000, 8, name="items")
            self.regularized = keras.layers.Embedding(100_000, 8, embeddings_constraint="non_neg", name="reg")
            self.head = keras.layers.Dense(1)

        def call(self, ids):
            return self.head(self.items(ids) + self.regularized(ids))

    with caplog.at_level(logging.INFO), swap_large_embeddings(1 << 20), use_embedding_backend(EmbeddingTables()):
        model = Ranker()
        model(tf.constant([[1, 2]], tf.int64))
    assert isinstance(model.items, Embedding) and model.items.table_name == "ranker/items/embeddings"
    assert type(model.regularized) is keras.layers.Embedding
    assert "`embeddings_constraint` is not supported" in caplog.text
    assert "__new__" not in keras.layers.Embedding.__dict__  # the patch is gone after the block


def test_a_failed_lookup_surfaces_as_its_own_exception(spec):
    """A worker retries a step on an unreachable PS by the gRPC error's type: TensorFlow must not hide it."""

    class Unreachable(ConnectionError):
        pass

    class DownPS:
        def lookup(self, name, ids, create, snapshot_id=0):
            raise Unreachable("PS 1 is down")

    trainer = Trainer(spec, {})
    features = tf.constant([[1, 2, 3]], tf.int64)
    trainer.ensure_built(features)
    trainer.connect(DownPS())
    with pytest.raises(Unreachable, match="PS 1 is down"):
        trainer.compute_gradients(features, tf.zeros((1, 1)))
