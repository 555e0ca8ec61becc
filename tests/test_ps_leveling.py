"""Sync shards leveled to one version at the end of training (ParameterServer.level_version and
PSClient.level_versions): issue 25, "every shard of a sync job ends at one version, whatever
grads_to_wait is" (docs/consistency.md, "One version at the end")."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.ps.server import StaleTermError
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc.ps_client import PSClient
from tests.test_ps_server import grads, make_ps, model


def two_shards_grouped_differently():
    """The same three gradients, grouped by grads_to_wait 2 on one shard and (its live-worker
    count lowered to 1 before they came, as a tell that reached it first) by 1 on the other."""
    behind, ahead = make_ps(grads_to_wait=2), make_ps(grads_to_wait=2)
    for ps in (behind, ahead):
        ps.push_model(model())
    ahead.set_live_workers(1)
    for scale in (1.0, 2.0, 3.0):
        behind.push_gradients(grads(scale), behind.shard.version, None)
        ahead.push_gradients(grads(scale), ahead.shard.version, None)
    behind.set_live_workers(0)  # training over: the pending third gradient is applied
    ahead.set_live_workers(0)
    return behind, ahead


def test_a_shard_behind_moves_up_to_the_version_of_the_others_its_parameters_unchanged():
    behind, ahead = two_shards_grouped_differently()
    assert (behind.shard.version, ahead.shard.version) == (2, 3)  # what the simulator found
    params = {n: v.copy() for n, v in behind.shard.params.items()}
    assert behind.level_version(3, term=0) == 3 and ahead.level_version(3, term=0) == 3
    assert behind.shard.version == ahead.shard.version == 3
    for name, value in params.items():
        np.testing.assert_array_equal(behind.shard.params[name], value)
    assert behind.pull(2)[1] == 3  # a worker holding the old version sees the new one


def test_leveling_never_moves_a_shard_back_nor_touches_an_async_one():
    ps = make_ps(grads_to_wait=1)
    ps.push_model(model())
    ps.push_gradients(grads(), 0, None)
    assert ps.level_version(0, term=0) == 1  # past it already: stays
    asynchronous = make_ps(use_async=True)
    asynchronous.push_model(model())
    assert asynchronous.level_version(5, term=0) == 0


def test_a_ps_that_holds_no_model_is_not_leveled_until_a_worker_refilled_it():
    """The simulator, seed 1475: a PS relaunched empty once every task was done; nobody pulled
    any more, and the job ended with that shard missing (at version 0)."""
    empty = make_ps(grads_to_wait=1)
    with pytest.raises(ValueError, match="holds no model"):
        empty.level_version(5, term=0)
    empty.push_model(model(), version=5)  # a waiting worker's refill (batch_loop._refill_while_waiting)
    assert empty.level_version(5, term=0) == 5


def test_leveling_is_refused_with_gradients_pending_or_from_an_older_term():
    ps = make_ps(grads_to_wait=2, term=3)
    ps.push_model(model())
    ps.push_gradients(grads(), 0, None)  # waits for a second one
    with pytest.raises(ValueError, match="wait in the average"):
        ps.level_version(4, term=3)
    with pytest.raises(StaleTermError):
        ps.level_version(4, term=2)
    ps.set_live_workers(0)  # applies the pending one: version 1
    with pytest.raises(ValueError, match="more than 10000 versions ahead"):
        ps.level_version(1 + 10_001, term=3)
    assert ps.shard.version == 1


def test_the_master_levels_every_ps_over_grpc_to_the_highest_version():
    servers, addresses = [], []
    shards = two_shards_grouped_differently()
    try:
        for core in shards:
            server = grpc_utils.make_server(max_workers=2)
            grpc_utils.add_service(server, "PServer", PServerServicer(core))
            addresses.append(f"127.0.0.1:{grpc_utils.bind_local(server, 0)}")
            server.start()
            servers.append(server)
        assert PSClient(addresses).level_versions() == 3
        assert [core.shard.version for core in shards] == [3, 3]
    finally:
        for server in servers:
            server.stop(grace=None)
