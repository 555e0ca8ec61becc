"""Every RPC field is checked where it arrives: each bad request over real gRPC is answered
INVALID_ARGUMENT or FAILED_PRECONDITION (a PS push: REJECTED_INVALID or REJECTED_STALE; a
master task report: a refused outcome) and changes nothing."""

from __future__ import annotations

import copy
import logging
import math
import queue
import threading

import grpc
import numpy as np
import pytest
from master_loop import master_servicer

from elasticdl.data.sources import Shard
from elasticdl.master.clocks import WorkerClocks
from elasticdl.master.controller import TaskReported, VersionReported
from elasticdl.master.evaluation_service import EvaluationService, FrozenSnapshot, TaskDispatcher
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.task_manager import TaskManager
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.model.sharding import ps_for_variable
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.ps import servicer as ps_servicer
from elasticdl.ps.server import MAX_SNAPSHOTS, ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.ps.strategies import VERSION_AHEAD_MARGIN
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc import codec as tensor_codec

LR = 0.1
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "dense/kernel": rng.normal(size=(3, 2)).astype(np.float32),
        "dense/bias": rng.normal(size=(2,)).astype(np.float32),
    }


def grads(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"dense/kernel": np.full((3, 2), scale, np.float32), "dense/bias": np.array([scale, -scale], np.float32)}


def model_message(params: dict[str, np.ndarray], declared=None, version: int = 0) -> elasticdl_pb2.Model:
    return elasticdl_pb2.Model(
        version=version, dense_parameters=tensor_codec.encode_dict(params),
        variables=sorted(params) if declared is None else declared,
    )


def push_request(gradients=None, version: int = 0, learning_rate: float | None = None) -> elasticdl_pb2.PushGradientsRequest:
    return elasticdl_pb2.PushGradientsRequest(
        worker_id=0, version=version, learning_rate=learning_rate,
        gradients=tensor_codec.encode_dict(grads() if gradients is None else gradients),
    )


def ps_state(core: ParameterServer):
    """What a refused request must leave as it was."""
    shard = core.shard
    return copy.deepcopy((shard.initialized, shard.version, shard.step, shard.params, shard.slots,
                          core._learning_rate, core.strategy.grads_to_wait, sorted(core._snapshots),
                          shard.non_trainable))


def assert_same(a, b):
    assert a[:3] == b[:3] and a[5:] == b[5:]
    for x, y in ((a[3], b[3]), *((a[4][n], b[4][n]) for n in a[4])):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])


class RealPS:
    """A ParameterServer behind a real gRPC server, and a stub to it."""

    def __init__(self, initialize: bool = True, non_trainable: dict | None = None, **settings):
        self.core = ParameterServer(PSSettings(**settings), make_optimizer(OptimizerSpec("SGD", {"learning_rate": LR})))
        if initialize:
            state = non_trainable or {}
            assert self.core.push_model({**model(), **state}, non_trainable=list(state)) == (True, 0)
        self.server = grpc_utils.make_server(max_workers=4)
        grpc_utils.add_service(self.server, "PServer", PServerServicer(self.core))
        port = grpc_utils.bind_local(self.server, 0)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc_utils.make_channel(self.address)
        self.stub = elasticdl_pb2_grpc.PServerStub(self.channel)

    def refused(self, method: str, request, code=INVALID, *contains: str) -> str:
        """Call ``method``; assert it was refused with ``code`` and changed nothing."""
        before = ps_state(self.core)
        with pytest.raises(grpc.RpcError) as info:
            reply = getattr(self.stub, method)(request, timeout=10)
            if hasattr(reply, "__next__"):  # a streamed answer: the error comes with its first message
                list(reply)
        assert info.value.code() == code, info.value.details()
        for text in contains:
            assert text in info.value.details()
        assert_same(ps_state(self.core), before)
        return info.value.details()

    def close(self):
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def ps():
    real = RealPS()
    yield real
    real.close()


@pytest.fixture
def async_ps():
    real = RealPS(use_async=True)
    yield real
    real.close()


# ---------------------------------------------------------------- pulls


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0, 1e9, 31.0])
def test_a_pull_timeout_that_is_not_finite_or_too_long_is_refused(ps, timeout):
    """NaN made the PS spin a core forever; 1e9 pinned a server thread."""
    request = elasticdl_pb2.PullDenseParametersRequest(version=0, wait_for_newer=True, timeout_seconds=timeout)
    ps.refused("pull_dense_parameters", request, INVALID, "timeout_seconds")
    ps.refused("pull_dense_parameters_stream", request, INVALID, "timeout_seconds")


def test_the_longest_pull_wait_is_the_workers_own():
    from elasticdl.worker.worker import SYNC_WAIT_SECONDS

    assert ps_servicer.MAX_PULL_WAIT_SECONDS == SYNC_WAIT_SECONDS


def test_a_pull_at_the_longest_wait_is_served(ps):
    # Version 5 is not the PS's (0): the answer comes at once, with the parameters.
    reply = ps.stub.pull_dense_parameters(
        elasticdl_pb2.PullDenseParametersRequest(version=5, wait_for_newer=True, timeout_seconds=30.0), timeout=10
    )
    assert reply.initialized and reply.version == 0 and len(reply.dense_parameters) == 2


@pytest.mark.parametrize("field, value", [("version", -2), ("version", -(2**63)), ("snapshot_id", -1)])
def test_a_pull_below_the_sentinels_is_refused(ps, field, value):
    ps.refused("pull_dense_parameters", elasticdl_pb2.PullDenseParametersRequest(**{field: value}), INVALID, field)


# ---------------------------------------------------------------- learning rates


@pytest.mark.parametrize("rate", [3e38, math.inf, math.nan, -0.5, 101.0])
def test_a_push_with_a_learning_rate_no_optimizer_takes_is_refused(ps, rate):
    before = ps_state(ps.core)
    reply = ps.stub.push_gradients(push_request(learning_rate=rate), timeout=10)
    assert reply.outcome == elasticdl_pb2.REJECTED_INVALID and not reply.accepted
    assert "learning rate" in reply.reason
    assert_same(ps_state(ps.core), before)


def test_a_push_rate_in_range_is_used_and_its_changes_logged(ps, caplog):
    caplog.set_level(logging.INFO, logger="elasticdl.ps.server")
    for rate, version in ((0.5, 0), (0.5, 1), (0.25, 2)):
        assert ps.stub.push_gradients(push_request(version=version, learning_rate=rate), timeout=10).applied
    expected = model()["dense/bias"] - (0.5 + 0.5 + 0.25) * grads()["dense/bias"]
    np.testing.assert_allclose(ps.core.shard.params["dense/bias"], expected, rtol=1e-6)
    logged = [r.getMessage() for r in caplog.records if "from the workers' schedule" in r.getMessage()]
    assert logged == [
        "learning rate 0.5 from the workers' schedule (was the optimizer's own)",
        "learning rate 0.25 from the workers' schedule (was 0.5)",
    ]


@pytest.mark.parametrize("rate", [1e30, math.inf, math.nan, -1.0, 100.5])
def test_set_learning_rate_refuses_a_rate_no_optimizer_takes(ps, rate):
    ps.refused("set_learning_rate", elasticdl_pb2.LearningRate(value=rate), INVALID, "learning rate")
    # The rate in use is still the optimizer's: a push moves the bias by LR * gradient.
    assert ps.stub.push_gradients(push_request(), timeout=10).applied
    np.testing.assert_allclose(ps.core.shard.params["dense/bias"], model()["dense/bias"] - LR * grads()["dense/bias"],
                               rtol=1e-6)


def test_set_learning_rate_in_range_is_taken_and_logged(ps, caplog):
    caplog.set_level(logging.INFO, logger="elasticdl.ps.server")
    ps.stub.set_learning_rate(elasticdl_pb2.LearningRate(value=0.5), timeout=10)
    ps.stub.set_learning_rate(elasticdl_pb2.LearningRate(), timeout=10)  # no value: the optimizer's own
    assert ps.core._learning_rate is None
    messages = [r.getMessage() for r in caplog.records]
    assert "learning rate set to 0.5 by the master (was the optimizer's own)" in messages
    assert "learning rate set to the optimizer's own by the master (was 0.5)" in messages


# ---------------------------------------------------------------- versions


def test_a_push_computed_on_a_negative_version_is_refused(async_ps):
    before = ps_state(async_ps.core)
    reply = async_ps.stub.push_gradients(push_request(version=-3), timeout=10)
    assert reply.outcome == elasticdl_pb2.REJECTED_INVALID and "version -3" in reply.reason
    assert async_ps.core.strategy.telemetry.staleness == {}  # no staleness of 3 was counted
    assert_same(ps_state(async_ps.core), before)


@pytest.mark.parametrize("ahead", [VERSION_AHEAD_MARGIN + 1, 2**62])
def test_an_async_push_far_ahead_of_the_ps_is_stale_and_changes_nothing(async_ps, ahead):
    before = ps_state(async_ps.core)
    reply = async_ps.stub.push_gradients(push_request(version=ahead), timeout=10)
    assert reply.outcome == elasticdl_pb2.REJECTED_STALE and "pull and compute it again" in reply.reason
    assert_same(ps_state(async_ps.core), before)
    # A little ahead (the PS restarted from an older checkpoint) still counts as fresh.
    assert async_ps.stub.push_gradients(push_request(version=VERSION_AHEAD_MARGIN), timeout=10).applied


# ---------------------------------------------------------------- empty and partial pushes


@pytest.mark.parametrize("use_async", [False, True])
def test_an_empty_push_to_a_ps_holding_dense_variables_is_refused(use_async):
    real = RealPS(use_async=use_async, grads_to_wait=2)
    try:
        before = ps_state(real.core)
        reply = real.stub.push_gradients(push_request(gradients={}), timeout=10)
        assert reply.outcome == elasticdl_pb2.REJECTED_INVALID and "an empty push" in reply.reason
        assert_same(ps_state(real.core), before)
        if not use_async:  # it did not count as one of the two gradients of the version
            real.stub.push_gradients(push_request(), timeout=10)
            assert real.core.shard.version == 0
    finally:
        real.close()


def test_an_empty_push_to_a_ps_without_dense_variables_keeps_versions_in_step():
    """A PS holding only embedding tables gets an empty push from a batch with none of its ids:
    it counts (docs/consistency.md), so every PS makes a version per batch."""
    real = RealPS(initialize=False, use_async=True)
    try:
        assert real.core.push_model({}) == (True, 0)
        reply = real.stub.push_gradients(push_request(gradients={}), timeout=10)
        assert reply.outcome == elasticdl_pb2.APPLIED and reply.version == 1
    finally:
        real.close()


def test_a_partial_sync_push_averages_the_missing_variables_as_zero():
    """The documented meaning of a partial push (TensorFlow gives no gradient for a variable the
    loss does not depend on): in sync mode the variable it leaves out counts as zero."""
    real = RealPS(grads_to_wait=2)
    try:
        real.stub.push_gradients(push_request(), timeout=10)
        reply = real.stub.push_gradients(push_request(gradients={"dense/bias": grads()["dense/bias"]}), timeout=10)
        assert reply.applied
        np.testing.assert_allclose(real.core.shard.params["dense/kernel"],
                                   model()["dense/kernel"] - LR * grads()["dense/kernel"] / 2, rtol=1e-6)
        np.testing.assert_allclose(real.core.shard.params["dense/bias"],
                                   model()["dense/bias"] - LR * grads()["dense/bias"], rtol=1e-6)
    finally:
        real.close()


# ---------------------------------------------------------------- non-trainable changes

MEAN = "bn/moving_mean"


@pytest.fixture
def bn_ps():
    real = RealPS(use_async=True, non_trainable={MEAN: np.zeros(2, np.float32)})
    yield real
    real.close()


def push_with_changes(changes: dict, gradients=None) -> elasticdl_pb2.PushGradientsRequest:
    request = push_request(gradients)
    request.non_trainable_changes.extend(tensor_codec.encode_dict(changes))
    return request


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("changes, gradients, reason", [
    ({"bn/nope": np.ones(2, np.float32)}, None, "unknown variable 'bn/nope'"),
    ({"dense/bias": np.ones(2, np.float32)}, {"dense/kernel": grads()["dense/kernel"]}, "which is trainable"),
    ({MEAN: np.ones(3, np.float32)}, None, "has shape (3,)"),
    ({MEAN: np.ones((), np.float32)}, None, "has shape ()"),
    ({MEAN: np.array([1, 2], np.int64)}, None, "dtype int64"),
    ({MEAN: np.array([np.nan, 0], np.float32)}, None, "NaN or Inf"),
    ({MEAN: np.array([np.inf, 0], np.float32)}, None, "NaN or Inf"),
    ({MEAN: np.array([1e300, 0], np.float64)}, None, "beyond float32"),
    ({}, {**grads(), MEAN: np.ones(2, np.float32)}, "which is non-trainable"),
])
def test_a_non_trainable_change_that_does_not_fit_is_refused_and_changes_nothing(
        bn_ps, streamed, changes, gradients, reason):
    before = ps_state(bn_ps.core)
    request = push_with_changes(changes, gradients)
    if streamed:
        reply = bn_ps.stub.push_gradients_stream(iter([request]), timeout=10)
    else:
        reply = bn_ps.stub.push_gradients(request, timeout=10)
    assert reply.outcome == elasticdl_pb2.REJECTED_INVALID and reason in reply.reason, reply.reason
    assert_same(ps_state(bn_ps.core), before)


def test_a_name_pushed_as_a_gradient_and_a_change_is_refused(bn_ps):
    bn_ps.refused("push_gradients", push_with_changes({"dense/bias": np.ones(2, np.float32)}), INVALID,
                  "appears twice")
    bad = elasticdl_pb2.Tensor(name=MEAN, dtype="float32", shape=[2], content=b"\0")
    request = push_request()
    request.non_trainable_changes.append(bad)
    bn_ps.refused("push_gradients", request, INVALID, MEAN)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_change_that_fits_is_added(bn_ps, streamed):
    request = push_with_changes({MEAN: np.array([1.5, -2], np.float32)})
    if streamed:
        reply = bn_ps.stub.push_gradients_stream(iter([request]), timeout=10)
    else:
        reply = bn_ps.stub.push_gradients(request, timeout=10)
    assert reply.applied
    np.testing.assert_array_equal(bn_ps.core.shard.params[MEAN], [1.5, -2])


@pytest.mark.parametrize("non_trainable, contains", [
    ([MEAN, MEAN], "once"),
    (["bn/undeclared"], "not among the model's declared"),
])
def test_a_model_whose_non_trainable_names_no_worker_sends_is_refused(empty_ps, non_trainable, contains):
    params = {**model(), MEAN: np.zeros(2, np.float32)}
    message = model_message(params)
    message.non_trainable.extend(non_trainable)
    empty_ps.refused("push_model", message, INVALID, contains)
    assert not empty_ps.core.shard.initialized


def test_the_workers_client_sends_each_change_to_the_ps_holding_it():
    from elasticdl.model.non_trainable import NonTrainableChange
    from elasticdl.rpc.ps_client import PSClient

    servers = [RealPS(initialize=False, ps_id=i, num_ps=2, use_async=True) for i in range(2)]
    try:
        client = PSClient([s.address for s in servers])
        params = {f"layer{i}/kernel": np.ones(2, np.float32) for i in range(4)}
        stats = {f"bn{i}/moving_mean": np.zeros(2, np.float32) for i in range(4)}
        assert client.push_model({**params, **stats}, non_trainable=list(stats)) == [True, True]
        for i, server in enumerate(servers):
            assert server.core.shard.non_trainable == {n for n in stats if ps_for_variable(n, 2) == i}
        step = {**{n: np.zeros(2, np.float32) for n in params},
                **{n: NonTrainableChange(np.full(2, k, np.float32)) for k, n in enumerate(stats)}}
        parts = client.split(step)
        answers = client.push_gradients(dict(enumerate(parts)), [0, 0], None, worker_id=0)
        assert all(a.applied for a in answers.values())
        pulled = {n: v for r in client.pull([-1, -1]) for n, v in r.params.items()}
        for k, name in enumerate(stats):
            np.testing.assert_array_equal(pulled[name], [k, k])
        client.close()
    finally:
        for s in servers:
            s.close()


# ---------------------------------------------------------------- push_model


@pytest.fixture
def empty_ps():
    real = RealPS(initialize=False)
    yield real
    real.close()


def test_a_partial_model_is_refused_and_the_ps_stays_empty(empty_ps):
    partial = {"dense/bias": model()["dense/bias"]}
    empty_ps.refused("push_model", model_message(partial, declared=sorted(model())), INVALID,
                     "a partial model", "dense/kernel")
    assert not empty_ps.core.shard.initialized


@pytest.mark.parametrize("case, message, contains", [
    ("undeclared", lambda: model_message(model(), declared=[]), "declared"),
    ("duplicate", lambda: model_message(model(), declared=["dense/bias", "dense/bias", "dense/kernel"]), "once"),
    ("nan", lambda: model_message({**model(), "dense/bias": np.array([np.nan, 1], np.float32)}), "NaN"),
    ("beyond_float32", lambda: model_message({**model(), "dense/bias": np.array([1e300, 1], np.float64)}), "NaN"),
    ("int", lambda: model_message({**model(), "dense/bias": np.array([1, 2], np.int64)}), "dtype int64"),
    ("negative_version", lambda: model_message(model(), version=-1), "version -1"),
    ("huge_version", lambda: model_message(model(), version=2**60), "version"),
])
def test_a_model_no_worker_pushes_is_refused(empty_ps, case, message, contains):
    empty_ps.refused("push_model", message(), INVALID, contains)
    assert not empty_ps.core.shard.initialized


def test_a_model_with_another_ps_variables_is_refused():
    names = [f"layer{i}/kernel" for i in range(8)]
    mine = [n for n in names if ps_for_variable(n, 2) == 0]
    theirs = [n for n in names if ps_for_variable(n, 2) == 1]
    assert mine and theirs
    real = RealPS(initialize=False, ps_id=0, num_ps=2)
    try:
        params = {n: np.ones(2, np.float32) for n in names}
        real.refused("push_model", model_message(params), INVALID, "belong to PS 1")
        assert not real.core.shard.initialized
        # Its own part of the declared model is taken, once; a second model is not.
        reply = real.stub.push_model(model_message({n: params[n] for n in mine}, declared=names), timeout=10)
        assert reply.accepted and sorted(real.core.shard.params) == sorted(mine)
        before = ps_state(real.core)
        again = {n: np.zeros(2, np.float32) for n in mine}
        assert not real.stub.push_model(model_message(again, declared=names), timeout=10).accepted
        assert_same(ps_state(real.core), before)
    finally:
        real.close()


def test_the_workers_client_declares_the_whole_model_to_every_ps():
    from elasticdl.rpc.ps_client import PSClient

    servers = [RealPS(initialize=False, ps_id=i, num_ps=2) for i in range(2)]
    try:
        client = PSClient([s.address for s in servers])
        params = {f"layer{i}/kernel": np.full(2, i, np.float32) for i in range(8)}
        assert client.push_model(params) == [True, True]
        assert sorted(n for s in servers for n in s.core.shard.params) == sorted(params)
        client.close()
    finally:
        for s in servers:
            s.close()


# ---------------------------------------------------------------- snapshots


def test_snapshots_are_bounded_the_oldest_evicted(ps):
    for snapshot_id in range(1, 101):
        ps.stub.take_snapshot(elasticdl_pb2.Snapshot(snapshot_id=snapshot_id), timeout=10)
    assert sorted(ps.core._snapshots) == list(range(101 - MAX_SNAPSHOTS, 101))
    assert len(ps.core._table_snapshots) == MAX_SNAPSHOTS
    assert ps.stub.pull_dense_parameters(elasticdl_pb2.PullDenseParametersRequest(snapshot_id=100), timeout=10).initialized
    ps.refused("pull_dense_parameters", elasticdl_pb2.PullDenseParametersRequest(snapshot_id=1),
               grpc.StatusCode.NOT_FOUND, "no snapshot 1")
    # Taking an id again replaces it: no growth.
    ps.stub.take_snapshot(elasticdl_pb2.Snapshot(snapshot_id=100), timeout=10)
    assert len(ps.core._snapshots) == MAX_SNAPSHOTS


@pytest.mark.parametrize("method", ["take_snapshot", "drop_snapshot"])
@pytest.mark.parametrize("snapshot_id", [0, -1])
def test_a_snapshot_id_that_is_not_positive_is_refused(ps, method, snapshot_id):
    ps.refused(method, elasticdl_pb2.Snapshot(snapshot_id=snapshot_id), INVALID, "snapshot_id")


# ---------------------------------------------------------------- other PS calls


def test_a_negative_live_worker_count_is_refused():
    real = RealPS(grads_to_wait=3)
    try:
        real.refused("set_live_workers", elasticdl_pb2.LiveWorkers(count=-1), INVALID, "negative")
        assert real.core.strategy.grads_to_wait == 3
    finally:
        real.close()


@pytest.mark.parametrize("method, request_, code, text", [
    ("restore", elasticdl_pb2.RestoreRequest(path="/etc", term=0), INVALID, "not a checkpoint under"),
    ("restore", elasticdl_pb2.RestoreRequest(path="x", term=-1), INVALID, "never negative"),
    ("fence", elasticdl_pb2.FenceRequest(handouts=[-1]), INVALID, "never negative"),
    ("save_checkpoint", elasticdl_pb2.SaveCheckpointRequest(at_version=-5), INVALID, "never negative"),
])
def test_rollback_and_fence_commands_no_master_sends_are_refused(ps, method, request_, code, text):
    ps.refused(method, request_, code, text)


def test_commands_of_a_deposed_masters_term_are_refused(ps):
    ps.core.term = 5
    for method, request_ in [("fence", elasticdl_pb2.FenceRequest(handouts=[1], term=4)),
                             ("set_learning_rate", elasticdl_pb2.LearningRate(value=0.5, term=4)),
                             ("save_checkpoint", elasticdl_pb2.SaveCheckpointRequest(term=4))]:
        ps.refused(method, request_, grpc.StatusCode.FAILED_PRECONDITION, "another master took over")
    assert ps.core.position.fenced == set()


def test_embedding_calls_refuse_negative_and_oversized_fields(ps):
    ids = tensor_codec.encode("ids", np.array([1], np.int64))
    ps.refused("pull_embedding_vectors", elasticdl_pb2.PullEmbeddingVectorsRequest(name="t", ids=ids, snapshot_id=-1),
               INVALID, "snapshot_id")
    with pytest.raises(grpc.RpcError) as info:
        list(ps.stub.pull_embedding_table(elasticdl_pb2.PullEmbeddingTableRequest(name="t", rows_per_chunk=-1),
                                          timeout=10))
    assert info.value.code() == INVALID and "rows_per_chunk" in info.value.details()
    wide = elasticdl_pb2.EmbeddingTableInfos(tables=[elasticdl_pb2.EmbeddingTableInfo(name="t", dim=1 << 40)])
    ps.refused("push_embedding_table_infos", wide, INVALID, "dim")
    assert ps.core.shard.embeddings == {}


@pytest.mark.parametrize("shape", [(2**40, 2**40), (0, 2**62, 2**62)])
def test_a_tensor_shape_numpy_cannot_hold_is_invalid_not_a_crash(ps, shape):
    bad = elasticdl_pb2.Tensor(name="dense/bias", dtype="float32", shape=shape, content=b"")
    request = elasticdl_pb2.PushGradientsRequest(version=0, gradients=[bad])
    ps.refused("push_gradients", request, INVALID, "dense/bias")
    ps.refused("push_gradients_stream", iter([request]), INVALID, "dense/bias")


# ---------------------------------------------------------------- reduced precision (--wire_dtype)


def half(arrays: dict[str, np.ndarray], wire_dtype: str) -> list[elasticdl_pb2.Tensor]:
    """``arrays`` as a worker with ``--wire_dtype wire_dtype`` sends them."""
    head = elasticdl_pb2.PushGradientsRequest.FromString(
        tensor_codec.serialize_with_tensors(elasticdl_pb2.PushGradientsRequest(), 4, arrays, wire_dtype))
    assert {t.dtype for t in head.gradients} == {wire_dtype}
    return list(head.gradients)


@pytest.mark.parametrize("method", ["push_gradients", "push_gradients_stream", "pull_dense_parameters",
                                    "pull_dense_parameters_stream"])
@pytest.mark.parametrize("wire_dtype", ["int8", "float64", "bf16"])
def test_a_wire_dtype_no_worker_sends_is_refused(ps, method, wire_dtype):
    if method.startswith("pull"):
        request = elasticdl_pb2.PullDenseParametersRequest(version=-1, wire_dtype=wire_dtype)
    else:
        request = push_request()
        request.wire_dtype = wire_dtype
    if method == "push_gradients_stream":
        request = iter([request])
    ps.refused(method, request, INVALID, f"wire_dtype {wire_dtype!r} is not one of float32, bfloat16, float16")


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_a_half_precision_gradient_of_the_wrong_length_is_refused(ps, streamed, wire_dtype):
    bad = elasticdl_pb2.Tensor(name="dense/bias", dtype=wire_dtype, shape=[2], content=bytes(8))  # float32's
    request = elasticdl_pb2.PushGradientsRequest(version=0, gradients=[half(grads(), wire_dtype)[0], bad])
    if streamed:  # read as a piece: one that runs past the tensor's 4 bytes
        ps.refused("push_gradients_stream", iter([request]), INVALID, "'dense/bias'", "bytes 0-8 of 4")
    else:
        ps.refused("push_gradients", request, INVALID, "'dense/bias'", "needs 4 bytes, message carries 8")


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e6])  # 1e6: beyond float16, inf on its wire
def test_a_half_precision_gradient_that_is_not_finite_is_refused_as_a_float32_one(ps, streamed, wire_dtype, bad):
    values = grads()
    values["dense/bias"][0] = bad
    request = elasticdl_pb2.PushGradientsRequest(version=0, gradients=half(values, wire_dtype))
    before = ps_state(ps.core)
    call = ps.stub.push_gradients_stream if streamed else ps.stub.push_gradients
    reply = call(iter([request]) if streamed else request, timeout=10)
    if bad == 1e6 and wire_dtype == "bfloat16":  # in bfloat16's range (float32's): applied
        assert reply.applied
        return
    assert reply.outcome == elasticdl_pb2.REJECTED_INVALID and "NaN or Inf" in reply.reason, reply.reason
    assert_same(ps_state(ps.core), before)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_the_workers_client_sends_and_pulls_half_precision_and_the_ps_keeps_float32(
        monkeypatch, streamed, wire_dtype):
    from elasticdl.rpc import ps_client

    if streamed:  # every push and pull of this small model streams, as a large one's would
        monkeypatch.setattr(ps_client, "STREAM_ABOVE_BYTES", 0)
    server = RealPS(initialize=False)
    client = ps_client.PSClient([server.address], wire_dtype=wire_dtype)
    try:
        start = model()
        assert client.push_model(start) == [True]
        np.testing.assert_array_equal(server.core.shard.params["dense/kernel"], start["dense/kernel"])  # exact
        pulled = client.pull([-1])[0].params
        tolerance = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[wire_dtype]
        for name, value in start.items():
            assert pulled[name].dtype == np.float32
            np.testing.assert_allclose(pulled[name], value, rtol=tolerance, atol=0)
        step = {name: (np.arange(value.size, dtype=np.float32).reshape(value.shape) + 1) / 3
                for name, value in start.items()}
        answer = client.push_gradients({0: step}, [0], None, worker_id=0, want_parameters=True)[0]
        assert answer.applied
        for name, value in start.items():
            held = server.core.shard.params[name]
            assert held.dtype == np.float32
            # SGD in float32 on the PS, with the gradient as it travelled: within its rounding.
            np.testing.assert_allclose(held, value - LR * step[name], rtol=0, atol=LR * np.abs(step[name]).max()
                                       * tolerance)
            if not streamed:  # a small model's unary push answers with the new parameters, cast too
                assert answer.params[name].dtype == np.float32
                np.testing.assert_allclose(answer.params[name], held, rtol=tolerance, atol=0)
        # Evaluation snapshots travel as float32: the model exactly as the PS holds it.
        server.core.take_snapshot(1)
        snapshot = client.pull_snapshot(1)[0].params
        np.testing.assert_array_equal(snapshot["dense/kernel"], server.core.shard.params["dense/kernel"])
    finally:
        client.close()
        server.close()


# ================================================================ the master


class RealMaster:
    """A MasterServicer over a real ledger (and an evaluation round) behind a real gRPC server."""

    def __init__(self, records: int = 10, metrics_fn=None):
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        main = TaskManager([Shard("train", 0, records)], shuffle=False)
        self.evaluation = None
        if metrics_fn is not None:
            self.evaluation = EvaluationService([Shard("valid", 0, 4), Shard("valid", 4, 8)], metrics_fn)
        self.dispatcher = TaskDispatcher(main, self.evaluation)
        self.progress = TrainingProgress(records, 1)
        self.server = grpc_utils.make_server(max_workers=4)
        elasticdl_pb2_grpc.add_MasterServicer_to_server(
            master_servicer(self.dispatcher, self.progress, WorkerClocks(), notify=self.events.put), self.server
        )
        port = grpc_utils.bind_local(self.server, 0)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc_utils.make_channel(self.address)
        self.stub = elasticdl_pb2_grpc.MasterStub(self.channel)

    def ledger(self):
        main = self.dispatcher.main
        return main.snapshot().tasks, [copy.copy(e) for e in main.epochs], self.progress.records_trained

    def task(self, worker_id: int = 0) -> elasticdl_pb2.Task:
        return self.stub.get_task(elasticdl_pb2.GetTaskRequest(worker_id=worker_id), timeout=10)

    def report(self, **fields) -> elasticdl_pb2.ReportTaskResultResponse:
        return self.stub.report_task_result(elasticdl_pb2.ReportTaskResultRequest(**fields), timeout=10)

    def close(self):
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture
def master():
    real = RealMaster()
    yield real
    real.close()


@pytest.mark.parametrize("fields, reason", [
    ({"records": 10**12}, "the task has 10"),
    ({"records": -1}, "never negative"),
    ({"records": 11, "interrupted": True}, "the task has 10"),
    ({"records": 10**12, "err_message": "boom"}, "the task has 10"),
    ({"batches": -5}, "batches"),
    ({"loss_sum": math.nan}, "loss sum"),
    ({"loss_sum": math.inf}, "loss sum"),
    ({"model_version": -7}, "model version"),
])
def test_a_task_report_no_worker_sends_is_refused_and_changes_nothing(master, fields, reason):
    """records=10**12 grew the progress line until the kernel killed the master."""
    task = master.task(worker_id=3)
    before = master.ledger()
    reply = master.report(worker_id=3, task_id=task.task_id, **{"records": 10, **fields})
    assert not reply.accepted and reason in reply.reason
    assert master.ledger() == before
    assert master.events.get(timeout=10) == TaskReported(task.task_id, 3, False)
    assert len(master.progress.line(0, master.dispatcher.main.epochs[0].records_done)) < 200
    # The worker holding it can still report it properly.
    assert master.report(worker_id=3, task_id=task.task_id, records=10).accepted
    assert master.dispatcher.main.epochs[0].records_done == 10


def test_a_report_under_another_workers_id_is_refused(master):
    task = master.task(worker_id=3)
    before = master.ledger()
    reply = master.report(worker_id=4, task_id=task.task_id, records=10)
    assert not reply.accepted and "assigned to worker 3, not 4" in reply.reason
    assert master.ledger() == before


def test_the_worker_logs_a_refused_report(master, caplog):
    from elasticdl.rpc.master_client import MasterClient

    caplog.set_level(logging.WARNING, logger="elasticdl.rpc.master_client")
    client = MasterClient(master.address, worker_id=1)
    try:
        order = client.get_task()
        assert not client.report(order.task_id, 10**12)
        assert any("refused the report of task" in r.getMessage() and "the task has 10" in r.getMessage()
                   for r in caplog.records)
    finally:
        client.close()


def test_a_negative_worker_id_gets_no_task(master):
    with pytest.raises(grpc.RpcError) as info:
        master.task(worker_id=-1)
    assert info.value.code() == INVALID
    assert master.dispatcher.main.counts() == (1, 0)


@pytest.mark.parametrize("worker_id, records_done, model_version, code", [
    (3, 11, 5, grpc.StatusCode.FAILED_PRECONDITION),  # more records than the task holds
    (3, -1, 5, grpc.StatusCode.FAILED_PRECONDITION),
    (4, 5, 5, grpc.StatusCode.FAILED_PRECONDITION),  # not the worker holding the task
    (3, 5, -9, INVALID),
])
def test_a_progress_report_no_worker_sends_is_refused_and_its_version_not_taken(
        master, worker_id, records_done, model_version, code):
    task = master.task(worker_id=3)
    before = master.ledger()
    with pytest.raises(grpc.RpcError) as info:
        master.stub.report_progress(elasticdl_pb2.ReportProgressRequest(
            worker_id=worker_id, task_id=task.task_id, records_done=records_done, model_version=model_version,
        ), timeout=10)
    assert info.value.code() == code
    assert master.ledger() == before
    assert master.events.empty()  # no VersionReported
    master.stub.report_progress(elasticdl_pb2.ReportProgressRequest(
        worker_id=3, task_id=task.task_id, records_done=5, model_version=5), timeout=10)
    assert master.events.get(timeout=10) == VersionReported(5)


@pytest.mark.parametrize("clock, blocked", [(-1, 0.0), (3, math.nan), (3, -1.0), (2**63 - 1, 0.0)])
def test_a_clock_report_no_worker_sends_is_refused(master, clock, blocked):
    with pytest.raises(grpc.RpcError) as info:
        master.stub.report_clock(elasticdl_pb2.ReportClockRequest(worker_id=0, clock=clock, blocked_seconds=blocked),
                                 timeout=10)
    assert info.value.code() == INVALID


# ---------------------------------------------------------------- evaluation rounds


def mean_metrics():
    """One plain function metric (state [sum, count]) and one Keras metric (total, count)."""
    import keras

    return {"abs_error": lambda y, p: np.abs(np.asarray(y) - np.asarray(p)).reshape(-1),
            "accuracy": keras.metrics.BinaryAccuracy()}


def good_states(total: float = 3.0) -> dict[str, np.ndarray]:
    return {"abs_error/0": np.array([total, 4.0]), "accuracy/0": np.float32(2.0), "accuracy/1": np.float32(4.0)}


@pytest.fixture
def eval_master():
    real = RealMaster(metrics_fn=mean_metrics)
    real.evaluation.start("test", FrozenSnapshot(real.evaluation.reserve_round(), 7))
    yield real
    real.close()


@pytest.mark.parametrize("states, reason", [
    ({**good_states(), "accuracy/2": np.float32(1)}, "unknown metric states"),
    ({"abs_error/0": np.array([3.0, 4.0]), "accuracy/0": np.float32(4e9)}, "missing"),
    ({**good_states(), "abs_error/0": np.array([3.0, 4.0, 5.0])}, "has shape (3,)"),
    ({**good_states(), "accuracy/0": np.ones((2, 2), np.float32)}, "has shape (2, 2)"),
    ({**good_states(), "abs_error/0": np.array([np.nan, 4.0])}, "NaN or Inf"),
    ({**good_states(), "accuracy/1": np.float32(np.inf)}, "NaN or Inf"),
])
def test_metric_states_that_do_not_fit_the_metrics_are_refused_before_the_task_counts(eval_master, states, reason):
    """Wrongly shaped states used to raise after the task was marked done, and the job died."""
    task = eval_master.task(worker_id=2)
    assert task.type == elasticdl_pb2.EVALUATION
    current = eval_master.evaluation.current
    reply = eval_master.report(worker_id=2, task_id=task.task_id, records=4,
                               metric_states=tensor_codec.encode_dict(states))
    assert not reply.accepted and reason in reply.reason
    assert current.merger.tasks == 0 and current.records == 0
    assert current.tasks.counts() == (1, 1)  # still in progress: the good report is taken
    assert eval_master.report(worker_id=2, task_id=task.task_id, records=4,
                              metric_states=tensor_codec.encode_dict(good_states())).accepted
    other = eval_master.task(worker_id=2)
    assert eval_master.report(worker_id=2, task_id=other.task_id, records=4,
                              metric_states=tensor_codec.encode_dict(good_states(1.0))).accepted
    result = eval_master.evaluation.poll()
    assert result.metrics == {"abs_error": pytest.approx(0.5), "accuracy": pytest.approx(0.5)}
    assert result.records == 8


def test_a_round_is_published_only_after_its_last_report_is_merged():
    """EvaluationService took no lock: a round could be published between the ledger marking
    the last task done and its states being merged."""
    service = EvaluationService([Shard("valid", 0, 4)], lambda: {"m": lambda y, p: np.zeros(1)})
    current = service.start("test", FrozenSnapshot(service.reserve_round(), 1))
    task = service.get_task(0)
    in_merge, release = threading.Event(), threading.Event()
    merge = current.merger.add

    def slow_merge(states):
        in_merge.set()
        release.wait(10)
        merge(states)

    current.merger.add = slow_merge
    reporter = threading.Thread(target=service.report, args=(task.task_id, 0, "", 4, {"m/0": np.array([2.0, 4.0])}))
    reporter.start()
    assert in_merge.wait(10)  # the ledger has marked the task done; its states are not merged yet
    published: list = []
    poller = threading.Thread(target=lambda: published.append(service.poll()))
    poller.start()
    poller.join(0.5)
    assert poller.is_alive(), "the round was published while its last report was being merged"
    release.set()
    reporter.join(10)
    poller.join(10)
    assert published[0].records == 4 and published[0].metrics == {"m": pytest.approx(0.5)}


@pytest.mark.parametrize("rate", [1e30, math.nan, -0.1])
def test_a_learning_rate_schedule_the_ps_would_refuse_fails_in_the_callback_by_name(rate):
    from elasticdl.callbacks import LearningRateScheduler
    from elasticdl.model.spec import ModelSpecError

    class Job:
        rates: list = []

        def set_learning_rate(self, value):
            self.rates.append(value)

    callback = LearningRateScheduler(lambda version: 0.1 if version < 5 else rate)
    callback.job = Job()
    callback.on_model_version(1)
    with pytest.raises(ModelSpecError, match=r"schedule\(5\) by version: learning rate"):
        callback.on_model_version(5)
    assert Job.rates == [0.1]
