"""The parameter server's core (no gRPC), its checkpoints, and its gRPC edge."""

from __future__ import annotations

import copy
import os

import grpc
import numpy as np
import pytest

from elasticdl.model import checkpoint
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.model.sharding import partition_by_ps
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc import codec as tensor_codec

LR = 0.1


def sgd():
    return make_optimizer(OptimizerSpec("SGD", {"learning_rate": LR}))


def adam():
    return make_optimizer(OptimizerSpec("Adam", {"learning_rate": 0.01}))


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.normal(size=(3, 2)).astype(np.float32),
        "dense/bias": rng.normal(size=(2,)).astype(np.float32),
    }


def grads(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "dense/kernel": np.full((3, 2), scale, np.float32),
        "dense/bias": np.array([scale, -scale], np.float32),
    }


def make_ps(optimizer=None, params=None, **settings) -> ParameterServer:
    ps = ParameterServer(PSSettings(**settings), optimizer or sgd())
    if params is not None:
        assert ps.push_model(params) == (True, 0)
    return ps


def state(ps: ParameterServer):
    """A deep copy of everything a push may change."""
    shard = ps.shard
    return copy.deepcopy((shard.params, shard.slots, shard.version, shard.step))


def assert_state_equal(a, b):
    pa, sa, va, ta = a
    pb, sb, vb, tb = b
    assert (va, ta) == (vb, tb)
    assert pa.keys() == pb.keys()
    for name in pa:
        np.testing.assert_array_equal(pa[name], pb[name])
        assert sa[name].keys() == sb[name].keys()
        for slot in sa[name]:
            np.testing.assert_array_equal(sa[name][slot], sb[name][slot])


# ---------------------------------------------------------------- model and pull


def test_first_pushed_model_wins():
    ps = make_ps()
    first, second = model(0), model(1)
    assert ps.push_model(first, version=5) == (True, 5)
    assert ps.push_model(second, version=9) == (False, 5)
    _, version, params = ps.pull(-1)
    assert version == 5
    for name in first:
        np.testing.assert_array_equal(params[name], first[name])
        assert params[name].dtype == np.float32


def test_push_model_copies_the_arrays():
    params = model()
    ps = make_ps(params=params)
    params["dense/bias"][:] = 99
    assert not np.any(ps.pull(-1)[2]["dense/bias"] == 99)


def test_pull_before_and_after_initialization():
    ps = make_ps()
    assert ps.pull(0) == (False, 0, {})
    ps.push_model(model())
    initialized, version, params = ps.pull(0)
    assert (initialized, version, params) == (True, 0, {})  # the worker is current
    initialized, version, params = ps.pull(-1)
    assert initialized and version == 0 and set(params) == set(model())


def test_pull_returns_copies():
    ps = make_ps(params=model())
    _, _, params = ps.pull(-1)
    params["dense/kernel"][:] = 123
    np.testing.assert_array_equal(ps.shard.params["dense/kernel"], model()["dense/kernel"])


# ---------------------------------------------------------------- sync and async


def test_sync_waits_then_applies_the_average():
    start = model()
    ps = make_ps(params=start, grads_to_wait=2)
    first = ps.push_gradients(grads(1.0), version=0, learning_rate=None)
    assert first.accepted and first.version == 0
    assert ps.pull(0)[2] == {}  # still version 0
    for name in start:
        np.testing.assert_array_equal(ps.shard.params[name], start[name])
    second = ps.push_gradients(grads(3.0), version=0, learning_rate=None)
    assert second.accepted and second.version == 1
    average = grads(2.0)
    for name in start:
        np.testing.assert_allclose(ps.shard.params[name], start[name] - LR * average[name], rtol=1e-6)
    # The next round starts from scratch: one push is not enough.
    ps.push_gradients(grads(1.0), version=1, learning_rate=None)
    assert ps.shard.version == 1


def test_sync_rejects_stale_gradients():
    ps = make_ps(params=model(), grads_to_wait=1)
    assert ps.push_gradients(grads(), 0, None).version == 1
    before = state(ps)
    result = ps.push_gradients(grads(5.0), version=0, learning_rate=None)
    assert not result.accepted
    assert "stale" in result.reason and result.version == 1
    assert_state_equal(state(ps), before)
    # A stale push does not count towards the next average either.
    ps2 = make_ps(params=model(), grads_to_wait=2)
    ps2.push_gradients(grads(1.0), 0, None)
    ps2.push_gradients(grads(1.0), 0, None)
    assert ps2.push_gradients(grads(100.0), 0, None).accepted is False
    ps2.push_gradients(grads(1.0), 1, None)
    assert ps2.shard.version == 1


def test_learning_rate_override():
    start = model()
    ps = make_ps(params=start)
    ps.push_gradients(grads(1.0), 0, learning_rate=0.5)
    np.testing.assert_allclose(ps.shard.params["dense/bias"], start["dense/bias"] - 0.5 * np.array([1, -1]))


def test_async_applies_every_push():
    start = model()
    ps = make_ps(params=start, use_async=True)
    results = [ps.push_gradients(grads(1.0), version=0, learning_rate=None) for _ in range(3)]
    assert [r.accepted for r in results] == [True] * 3
    assert [r.version for r in results] == [1, 2, 3]
    np.testing.assert_allclose(
        ps.shard.params["dense/kernel"], start["dense/kernel"] - 3 * LR, rtol=1e-6
    )


def test_partial_gradients_update_only_their_variables():
    start = model()
    ps = make_ps(params=start, use_async=True)
    ps.push_gradients({"dense/bias": np.ones(2, np.float32)}, 0, None)
    np.testing.assert_array_equal(ps.shard.params["dense/kernel"], start["dense/kernel"])
    assert not np.array_equal(ps.shard.params["dense/bias"], start["dense/bias"])


BAD_GRADIENTS = {
    "unknown": ({"dense/other": np.ones(2, np.float32)}, "unknown variable 'dense/other'"),
    "shape": ({"dense/bias": np.ones(3, np.float32)}, "'dense/bias' has shape (3,)"),
    "int": ({"dense/bias": np.ones(2, np.int64)}, "'dense/bias' has dtype int64"),
    "nan": ({"dense/bias": np.array([1.0, np.nan], np.float32)}, "'dense/bias' contains NaN"),
    "inf": ({"dense/bias": np.array([np.inf, 1.0], np.float32)}, "'dense/bias' contains NaN or Inf"),
}


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("kind", sorted(BAD_GRADIENTS))
def test_bad_gradients_rejected_and_nothing_changes(kind, use_async):
    ps = make_ps(adam(), params=model(), use_async=use_async, grads_to_wait=1 if use_async else 2)
    ps.push_gradients(grads(1.0), 0, None)  # slots non-zero; in sync, one gradient pending
    before = state(ps)
    bad, message = BAD_GRADIENTS[kind]
    # A good gradient alongside the bad one must not be applied either.
    result = ps.push_gradients({"dense/kernel": np.ones((3, 2), np.float32), **bad}, ps.shard.version, None)
    assert not result.accepted
    assert message in result.reason
    assert result.version == before[2]
    assert_state_equal(state(ps), before)
    if not use_async:
        # The pending gradient is still the only one: the next good push completes the round
        # with the average of exactly those two.
        ps.push_gradients(grads(3.0), 0, None)
        reference = make_ps(adam(), params=model(), grads_to_wait=2)
        reference.push_gradients(grads(1.0), 0, None)
        reference.push_gradients(grads(3.0), 0, None)
        assert ps.shard.version == 1
        assert_state_equal(state(ps), state(reference))


def test_push_before_model_rejected():
    ps = make_ps()
    result = ps.push_gradients(grads(), 0, None)
    assert not result.accepted and "holds no model" in result.reason  # stale: pull (refill), compute again


# ---------------------------------------------------------------- checkpoints


def versions_on_disk(directory) -> list[int]:
    return sorted(int(d.split("-")[1]) for d in os.listdir(directory) if d.startswith("version-"))


def test_checkpoint_every_n_versions_and_pruning(tmp_path):
    ckpt = tmp_path / "ckpt"
    ps = make_ps(params=model(), checkpoint_dir=str(ckpt), checkpoint_steps=2, keep_checkpoint_max=2)
    seen = []
    for step in range(1, 7):
        ps.push_gradients(grads(), ps.shard.version, None)
        seen.append(versions_on_disk(ckpt) if ckpt.exists() else [])
        if step == 2:
            assert os.path.isfile(ckpt / "version-2" / "ps-0-of-1.npz")
    assert seen == [[], [2], [2], [2, 4], [2, 4], [4, 6]]
    assert not any(name.endswith(".tmp.npz") for _, _, files in os.walk(ckpt) for name in files)
    # save_checkpoint at a version already saved returns it without rewriting.
    assert ps.save_checkpoint() == f"{ckpt}/version-6"
    ps.push_gradients(grads(), ps.shard.version, None)
    assert ps.save_checkpoint() == f"{ckpt}/version-7"
    assert versions_on_disk(ckpt) == [6, 7]


def test_no_checkpoint_for_a_version_no_push_produced(tmp_path):
    # Sync with grads_to_wait=2: the first push leaves the model at version 0, which is the
    # pushed initial model, not a training result; it must not be checkpointed.
    ckpt = tmp_path / "ckpt"
    ps = make_ps(params=model(), grads_to_wait=2, checkpoint_dir=str(ckpt), checkpoint_steps=1)
    ps.push_gradients(grads(), 0, None)
    assert not ckpt.exists() or versions_on_disk(ckpt) == []
    ps.push_gradients(grads(), 0, None)
    assert versions_on_disk(ckpt) == [1]


def test_save_checkpoint_without_dir_or_model(tmp_path):
    assert make_ps(params=model()).save_checkpoint() == ""
    assert make_ps(checkpoint_dir=str(tmp_path)).save_checkpoint() == ""
    assert os.listdir(tmp_path) == []


def many_variables() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {
        f"block_{i}/{kind}": rng.normal(size=(i % 3 + 1, 2)).astype(np.float32)
        for i in range(10)
        for kind in ("kernel", "bias")
    }


def train_sharded(tmp_path, num_ps: int, steps: int = 3):
    """``num_ps`` Adam servers holding their share of the model, trained ``steps`` versions."""
    full = many_variables()
    servers = []
    for ps_id, names in enumerate(partition_by_ps(full, num_ps)):
        assert names, "every PS should hold something in this test"
        ps = make_ps(
            adam(), params={n: full[n] for n in names}, ps_id=ps_id, num_ps=num_ps,
            checkpoint_dir=str(tmp_path / "ckpt"),
        )
        for step in range(steps):
            g = {n: np.full_like(full[n], 0.1 * (step + 1) * (1 + ps_id)) for n in names}
            assert ps.push_gradients(g, ps.shard.version, None).accepted
        servers.append(ps)
    return servers


def merged(servers):
    params, slots = {}, {}
    for ps in servers:
        for name, value in ps.shard.params.items():
            assert name not in params, f"{name} restored twice"
            params[name] = value
            slots[name] = ps.shard.slots[name]
    return params, slots


@pytest.mark.parametrize("new_num_ps", [1, 2, 3])
def test_checkpoint_restores_onto_a_different_number_of_ps(tmp_path, new_num_ps):
    old = train_sharded(tmp_path, num_ps=2)
    paths = {ps.save_checkpoint() for ps in old}
    assert paths == {f"{tmp_path / 'ckpt'}/version-3"}
    assert sorted(os.listdir(tmp_path / "ckpt" / "version-3")) == ["ps-0-of-2.npz", "ps-1-of-2.npz"]
    old_params, old_slots = merged(old)

    restored = []
    for ps_id in range(new_num_ps):
        ps = ParameterServer(
            PSSettings(ps_id=ps_id, num_ps=new_num_ps, checkpoint_dir_for_init=str(tmp_path / "ckpt")), adam()
        )
        ps.restore()
        assert ps.shard.initialized and ps.shard.version == 3 and ps.shard.step == 3
        # The restored model wins over a worker's freshly initialized one.
        assert ps.push_model(many_variables()) == (False, 3)
        restored.append(ps)
    new_params, new_slots = merged(restored)
    assert new_params.keys() == old_params.keys()
    for name in old_params:
        np.testing.assert_array_equal(new_params[name], old_params[name])
        assert new_slots[name].keys() == {"momentum", "velocity"}
        for slot in ("momentum", "velocity"):
            assert np.any(old_slots[name][slot] != 0)
            np.testing.assert_array_equal(new_slots[name][slot], old_slots[name][slot])

    # Training continues exactly as it would have without the restart (Adam's bias
    # correction depends on the restored step).
    step_grads = {n: np.full_like(v, 0.3) for n, v in old_params.items()}
    for group in (old, restored):
        for ps in group:
            mine = {n: step_grads[n] for n in ps.shard.params}
            assert ps.push_gradients(mine, 3, None).accepted
    after_old, _ = merged(old)
    after_new, _ = merged(restored)
    for name in after_old:
        np.testing.assert_array_equal(after_new[name], after_old[name])


def test_restored_model_is_not_rewritten_before_training_moves_on(tmp_path):
    for ps in train_sharded(tmp_path, num_ps=2):
        ps.save_checkpoint()
    ckpt = tmp_path / "ckpt"
    ps = ParameterServer(
        PSSettings(num_ps=1, grads_to_wait=2, checkpoint_dir=str(ckpt), checkpoint_steps=1,
                   checkpoint_dir_for_init=str(ckpt)),
        adam(),
    )
    ps.restore()
    g = {n: np.ones_like(v) for n, v in ps.shard.params.items()}
    ps.push_gradients(g, 3, None)  # pending: still version 3
    # Not a third file (ps-0-of-1) mixed into the 2-PS version-3 directory.
    assert sorted(os.listdir(ckpt / "version-3")) == ["ps-0-of-2.npz", "ps-1-of-2.npz"]
    ps.push_gradients(g, 3, None)
    assert versions_on_disk(ckpt) == [3, 4]
    assert os.listdir(ckpt / "version-4") == ["ps-0-of-1.npz"]


def test_load_shard_picks_the_latest_complete_version(tmp_path):
    servers = train_sharded(tmp_path, num_ps=2, steps=1)
    for ps in servers:
        ps.save_checkpoint()
    # Version 2 written by only one of the two servers: incomplete, ignored.
    servers[0].push_gradients({n: np.ones_like(v) for n, v in servers[0].shard.params.items()}, 1, None)
    servers[0].save_checkpoint()
    ckpt = str(tmp_path / "ckpt")
    assert checkpoint.complete_versions(ckpt) == [1]
    assert checkpoint.load_shard(ckpt, 0, 1).version == 1
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.load_shard(os.path.join(ckpt, "version-2"), 0, 1)
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.load_shard(str(tmp_path / "nothing"), 0, 1)


def test_prune_keeps_all_with_zero(tmp_path):
    ps = make_ps(params=model(), checkpoint_dir=str(tmp_path), checkpoint_steps=1, keep_checkpoint_max=0)
    for _ in range(5):
        ps.push_gradients(grads(), ps.shard.version, None)
    assert versions_on_disk(tmp_path) == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- gRPC edge


@pytest.fixture
def grpc_ps():
    core = make_ps()
    server = grpc_utils.make_server(max_workers=4)
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server, 0)
    server.start()
    channel = grpc_utils.make_channel(f"127.0.0.1:{port}")
    try:
        yield core, elasticdl_pb2_grpc.PServerStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)


def test_grpc_rejects_malformed_tensors(grpc_ps):
    core, stub = grpc_ps
    bad = elasticdl_pb2.Tensor(name="dense/bias", dtype="float32", shape=[2], content=b"\0" * 5)

    # A malformed model is not taken.
    with pytest.raises(grpc.RpcError) as info:
        stub.push_model(elasticdl_pb2.Model(version=0, dense_parameters=[bad]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dense/bias" in info.value.details()
    assert not core.shard.initialized

    response = stub.push_model(
        elasticdl_pb2.Model(version=0, dense_parameters=tensor_codec.encode_dict(model()), variables=sorted(model())),
        timeout=10,
    )
    assert response.accepted and response.version == 0
    before = state(core)

    # A malformed gradient changes nothing.
    request = elasticdl_pb2.PushGradientsRequest(
        worker_id=1, version=0, gradients=[tensor_codec.encode("dense/kernel", np.ones((3, 2), np.float32)), bad]
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.push_gradients(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 8 bytes" in info.value.details()
    assert_state_equal(state(core), before)

    # A well-formed but unusable gradient is refused in the response, not by aborting.
    response = stub.push_gradients(
        elasticdl_pb2.PushGradientsRequest(
            worker_id=1, version=0, gradients=[tensor_codec.encode("nope", np.ones(2, np.float32))]
        ),
        timeout=10,
    )
    assert not response.accepted and "unknown variable 'nope'" in response.reason
    assert_state_equal(state(core), before)

    # And a good one goes through; the pull shows it.
    response = stub.push_gradients(
        elasticdl_pb2.PushGradientsRequest(worker_id=1, version=0, gradients=tensor_codec.encode_dict(grads())),
        timeout=10,
    )
    assert response.accepted and response.version == 1
    pulled = stub.pull_dense_parameters(elasticdl_pb2.PullDenseParametersRequest(version=0), timeout=10)
    assert pulled.initialized and pulled.version == 1
    params = tensor_codec.decode_list(pulled.dense_parameters)
    np.testing.assert_allclose(params["dense/kernel"], model()["dense/kernel"] - LR, rtol=1e-6)
    current = stub.pull_dense_parameters(elasticdl_pb2.PullDenseParametersRequest(version=1), timeout=10)
    assert current.version == 1 and len(current.dense_parameters) == 0


def big_model() -> dict[str, np.ndarray]:
    """Larger than STREAM_ABOVE_BYTES, so the client streams it (and a small variable rides along)."""
    rng = np.random.default_rng(3)
    return {"big/kernel": rng.normal(size=(1500, 1000)).astype(np.float32), "big/bias": np.ones(7, np.float32)}


@pytest.fixture
def grpc_ps_address():
    core = make_ps(use_async=True)
    server = grpc_utils.make_server(max_workers=4)
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server, 0)
    server.start()
    try:
        yield core, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_large_models_stream_in_pieces_and_equal_the_unary_path(grpc_ps_address, monkeypatch):
    from elasticdl.rpc import ps_client
    from elasticdl.rpc.ps_client import PSClient

    core, address = grpc_ps_address
    client = PSClient([address])
    calls = []
    stub = client._stubs[0]
    for name in ("pull_dense_parameters_stream", "push_gradients_stream"):
        method = getattr(stub, name)
        monkeypatch.setattr(stub, name, lambda request, method=method, name=name: calls.append(name) or method(request))
    params = big_model()
    assert client.push_model(params) == [True]
    pulled = client.pull([-1])[0]
    assert calls == ["pull_dense_parameters_stream"]
    assert (pulled.initialized, pulled.version) == (True, 0)
    for name, value in params.items():
        np.testing.assert_array_equal(pulled.params[name], value)

    gradient = {name: np.full_like(value, 0.5) for name, value in params.items()}
    answer = client.push_gradients({0: gradient}, [0], None, worker_id=0)[0]
    assert calls == ["pull_dense_parameters_stream", "push_gradients_stream"]
    assert (answer.accepted, answer.version) == (True, 1)
    for name, value in params.items():
        np.testing.assert_allclose(core.shard.params[name], value - LR * 0.5, rtol=1e-6)

    # Below the threshold the same calls are unary (a stream costs more per call).
    monkeypatch.setattr(ps_client, "STREAM_ABOVE_BYTES", 1 << 30)
    client.push_gradients({0: gradient}, [1], None, worker_id=0)
    assert client.pull([0])[0].version == 2
    assert calls == ["pull_dense_parameters_stream", "push_gradients_stream"]
    client.close()


def test_a_malformed_streamed_push_changes_nothing(grpc_ps_address):
    core, address = grpc_ps_address
    assert core.push_model(big_model()) == (True, 0)
    before = state(core)
    channel = grpc_utils.make_channel(address)
    stub = elasticdl_pb2_grpc.PServerStub(channel)
    head = elasticdl_pb2.PushGradientsRequest(worker_id=0, version=0)
    field = elasticdl_pb2.PushGradientsRequest.DESCRIPTOR.fields_by_name["gradients"].number
    messages = [elasticdl_pb2.PushGradientsRequest.FromString(m) for m in tensor_codec.serialize_chunks(
        head, field, {name: np.ones_like(v) for name, v in big_model().items()})]
    assert len(messages) > 2
    for broken, reason in [
        (messages[:1] + messages[2:], "the next piece should start at"),  # a message lost
        (messages[:-2], "bytes arrived"),  # the stream ended early
        ([], "an empty push"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stub.push_gradients_stream(iter(broken), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason in info.value.details()
        assert_state_equal(state(core), before)
    assert stub.push_gradients_stream(iter(messages), timeout=10).accepted
    assert core.shard.version == 1
    channel.close()


def test_a_push_that_makes_a_version_can_answer_with_its_parameters(grpc_ps_address):
    from elasticdl.rpc.ps_client import PSClient

    core, address = grpc_ps_address
    client = PSClient([address])
    assert client.push_model(model()) == [True]
    # The size of the model is not known before a pull: no parameters in the answer yet.
    assert client.push_gradients({0: grads()}, [0], None, 0, want_parameters=True)[0].params is None
    client.pull([-1])
    answer = client.push_gradients({0: grads()}, [1], None, 0, want_parameters=True)[0]
    assert answer.version == 2 and answer.params is not None
    pulled = client.pull([-1])[0]
    assert pulled.version == 2
    for name, value in pulled.params.items():
        np.testing.assert_array_equal(answer.params[name], value)
    # Not asked, or refused: no parameters.
    assert client.push_gradients({0: grads()}, [2], None, 0)[0].params is None
    refused = client.push_gradients({0: {"nope": np.ones(2, np.float32)}}, [3], None, 0, want_parameters=True)[0]
    assert not refused.accepted and refused.params is None
    client.close()


def test_a_sync_push_waiting_for_others_answers_without_parameters():
    ps = make_ps(params=model(), grads_to_wait=2)
    encode = lambda result, params: (result, params)  # noqa: E731
    result, params = ps.push_gradients(grads(), 0, None, encode)
    assert result.accepted and not result.applied and params is None
    result, params = ps.push_gradients(grads(), 0, None, encode)
    assert result.applied and result.version == 1
    np.testing.assert_allclose(params["dense/bias"], model()["dense/bias"] - LR * grads()["dense/bias"], rtol=1e-6)


@pytest.fixture
def sync_ps_address():
    core = make_ps(grads_to_wait=2)
    server = grpc_utils.make_server(max_workers=4)
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server, 0)
    server.start()
    try:
        yield core, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("streamed", [False, True])
def test_push_outcomes_travel_as_the_protocols_enum(sync_ps_address, monkeypatch, streamed):
    """Every outcome over real gRPC, unary and streamed: the worker reads the enum, not the reason."""
    from elasticdl.rpc import ps_client
    from elasticdl.rpc.ps_client import PSClient
    from elasticdl.rpc.push_outcome import PushOutcome

    if streamed:
        monkeypatch.setattr(ps_client, "STREAM_ABOVE_BYTES", 0)
    core, address = sync_ps_address
    client = PSClient([address])
    assert client.push_model(model()) == [True]

    def push(gradients, version):
        return client.push_gradients({0: gradients}, [version], None, worker_id=0)[0]

    first = push(grads(), 0)
    assert (first.outcome, first.accepted, first.applied, first.version) == (PushOutcome.ACCEPTED_PENDING, True,
                                                                              False, 0)
    second = push(grads(), 0)
    assert (second.outcome, second.applied, second.version) == (PushOutcome.APPLIED, True, 1)
    stale = push(grads(), 0)
    assert (stale.outcome, stale.accepted, stale.version) == (PushOutcome.REJECTED_STALE, False, 1)
    assert "computed on version 0" in stale.reason
    invalid = push({"nope": np.ones(2, np.float32)}, 1)
    assert (invalid.outcome, invalid.accepted) == (PushOutcome.REJECTED_INVALID, False)
    assert "unknown variable 'nope'" in invalid.reason
    assert core.shard.version == 1
    client.close()

    # On the wire: the enum field, with the booleans kept for older readers.
    channel = grpc_utils.make_channel(address)
    stub = elasticdl_pb2_grpc.PServerStub(channel)
    reply = stub.push_gradients(
        elasticdl_pb2.PushGradientsRequest(worker_id=1, version=0, gradients=tensor_codec.encode_dict(grads())),
        timeout=10,
    )
    assert reply.outcome == elasticdl_pb2.REJECTED_STALE and not reply.accepted and not reply.applied
    channel.close()
