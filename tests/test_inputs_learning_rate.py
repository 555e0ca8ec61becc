"""A learning rate of 0 is a rate: the updates change nothing. Only "no rate" (None; a
message without the field) means the optimizer's own.

A LearningRateScheduler returning 0 used to train at the optimizer's own rate: the callback
sent 0, the PS client put 0 on the wire, where 0 was the "unset" sentinel, and the PS's
servicer turned it into None. The chain is tested here at the PS core and over real gRPC
(the servicer and the client), for the master's rate and a worker's rate, in sync, async
and with the staleness modulation.
"""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.callbacks import LearningRateScheduler
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.model.spec import ModelSpecError
from elasticdl.proto import elasticdl_pb2
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc.ps_client import PSClient

LR = 0.1
MODEL = {"w": np.array([1.0, -2.0, 3.0], np.float32)}
GRAD = {"w": np.array([1.0, 1.0, -1.0], np.float32)}


def _core(**settings) -> ParameterServer:
    core = ParameterServer(PSSettings(**settings), make_optimizer(OptimizerSpec("SGD", {"learning_rate": LR})))
    assert core.push_model(dict(MODEL)) == (True, 0)
    return core


def _w(core: ParameterServer) -> np.ndarray:
    return core.shard.params["w"].copy()


def _push(core: ParameterServer, learning_rate: float | None):
    return core.push_gradients({"w": GRAD["w"].copy()}, core.shard.version, learning_rate)


# ---------------------------------------------------------------- the PS core


@pytest.mark.parametrize("settings", [{}, {"use_async": True}, {"grads_to_wait": 2},
                                      {"use_async": True, "lr_staleness_modulation": True}],
                         ids=["sync", "async", "sync, grads_to_wait 2", "async, staleness modulation"])
def test_a_rate_of_0_applies_no_update_and_none_the_optimizers_rate(settings):
    core = _core(**settings)
    pushes = settings.get("grads_to_wait", 1)
    core.set_learning_rate(0.0)  # the master's rate (a LearningRateScheduler)
    for _ in range(pushes):
        assert _push(core, None).accepted
    assert core.shard.version == 1  # applied: a version like any other, that changed nothing
    np.testing.assert_array_equal(_w(core), MODEL["w"])
    core.set_learning_rate(None)
    for _ in range(pushes):
        _push(core, 0.0)  # a worker's rate (the model zoo's learning_rate_scheduler)
    assert core.shard.version == 2
    np.testing.assert_array_equal(_w(core), MODEL["w"])
    for _ in range(pushes):
        _push(core, None)  # neither: the optimizer's own
    np.testing.assert_allclose(_w(core), MODEL["w"] - LR * GRAD["w"], rtol=1e-6)


def test_a_stale_push_at_rate_0_stays_at_0_under_the_staleness_modulation():
    core = _core(use_async=True, lr_staleness_modulation=True)
    _push(core, None)
    before = _w(core)
    assert core.push_gradients({"w": GRAD["w"].copy()}, 0, 0.0).applied  # one version stale: rate 0 / 2
    np.testing.assert_array_equal(_w(core), before)


def test_a_negative_rate_is_still_refused_and_changes_nothing():
    core = _core()
    with pytest.raises(ValueError, match="learning rate -0.5 is negative"):
        core.set_learning_rate(-0.5)
    assert core._learning_rate is None


# ---------------------------------------------------------------- over gRPC


@pytest.fixture
def served():
    core = _core()
    server = grpc_utils.make_server(max_workers=4)
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server, 0)
    server.start()
    client = PSClient([f"127.0.0.1:{port}"])
    yield core, client
    client.close()
    server.stop(0)


def test_rate_0_and_no_rate_travel_apart_from_the_master_and_the_worker(served):
    core, client = served
    client.set_learning_rate(0.0)
    assert core._learning_rate == 0.0
    assert client.push_gradients({0: GRAD}, [0], None, worker_id=0)[0].applied
    np.testing.assert_array_equal(_w(core), MODEL["w"])
    client.set_learning_rate(None)
    assert core._learning_rate is None
    assert client.push_gradients({0: GRAD}, [1], 0.0, worker_id=0)[0].applied
    np.testing.assert_array_equal(_w(core), MODEL["w"])
    assert client.push_gradients({0: GRAD}, [2], None, worker_id=0)[0].applied
    np.testing.assert_allclose(_w(core), MODEL["w"] - LR * GRAD["w"], rtol=1e-6)


def test_the_wire_tells_a_rate_of_0_from_no_rate():
    assert elasticdl_pb2.LearningRate(value=0.0).HasField("value")
    assert not elasticdl_pb2.LearningRate(value=None).HasField("value")
    sent = elasticdl_pb2.PushGradientsRequest(learning_rate=0.0).SerializeToString()
    assert elasticdl_pb2.PushGradientsRequest.FromString(sent).HasField("learning_rate")
    assert not elasticdl_pb2.PushGradientsRequest().HasField("learning_rate")


# ---------------------------------------------------------------- the callback


class _Job:
    def __init__(self) -> None:
        self.rates: list[float | None] = []

    def set_learning_rate(self, learning_rate: float | None) -> None:
        self.rates.append(learning_rate)


def test_a_schedule_returning_0_sets_0_and_none_goes_back_to_the_optimizers_rate():
    schedule = {0: 0.5, 1: 0, 2: 0.0, 3: None}
    callback = LearningRateScheduler(lambda epoch: schedule[epoch], by="epoch")
    callback.job = _Job()
    callback.on_train_begin()
    for epoch in (1, 2, 3):
        callback.on_epoch_begin(epoch)
    assert callback.job.rates == [0.5, 0.0, None]  # 0 then 0.0: one change; None: back to the own


def test_a_schedule_returning_a_negative_rate_is_named():
    callback = LearningRateScheduler(lambda version: -1.0)
    callback.job = _Job()
    with pytest.raises(ModelSpecError, match=r"schedule\(0\) by version: learning rate -1.0 is negative"):
        callback.on_train_begin()
    assert callback.job.rates == []
