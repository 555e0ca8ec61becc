"""Sync workers waiting for a version never take the PS's gRPC threads from pushes and pulls.

A waiting pull holds a server thread only while it waits in one of the PS's few wait slots
(elasticdl/ps/server.py MAX_WAITING_PULLS), at most a slice of time; every other waiting
pull is answered "not yet" at once and the client asks again (rpc/ps_client.py).
"""

from __future__ import annotations

import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps import server as ps_server
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc.ps_client import PSClient

TIMEOUT = 30.0  # generous: every wait below ends on an event long before it


def make_ps(grads_to_wait: int = 1, **limits) -> ParameterServer:
    ps = ParameterServer(
        PSSettings(grads_to_wait=grads_to_wait), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.5})),
        **limits,
    )
    ps.push_model({"w": np.zeros(3, np.float32)})
    return ps


def grad(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32)}


def eventually(predicate, timeout: float = TIMEOUT) -> bool:
    """Wait for ``predicate`` (polled every ms): a condition to reach, not a timing window."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    thread.start()
    return thread, out


# ---------------------------------------------------------------- the core's wait slots


def test_pulls_past_the_wait_slots_are_told_not_yet_at_once():
    ps = make_ps(max_waiting_pulls=2, wait_slice=TIMEOUT * 2)
    waiters = [in_thread(lambda: ps.pull(0, wait_for_newer=True, timeout=TIMEOUT * 2)) for _ in range(2)]
    assert eventually(lambda: ps.waiting_pulls == 2)

    # A third waiting pull finds every slot taken: its answer is "still at 0", now.
    third, out = in_thread(lambda: ps.pull(0, wait_for_newer=True, timeout=TIMEOUT * 2))
    third.join(TIMEOUT)
    assert not third.is_alive() and out["result"] == (True, 0, {})
    assert ps.pulls_told_not_yet == 1 and ps.waiting_pulls == 2

    ps.push_gradients(grad(), 0, None)
    for thread, out in waiters:
        thread.join(TIMEOUT)
        initialized, version, params = out["result"]
        assert initialized and version == 1 and set(params) == {"w"}
    assert ps.waiting_pulls == 0


def test_a_wait_ends_after_its_slice_and_frees_the_slot():
    ps = make_ps(max_waiting_pulls=1, wait_slice=0.05)
    thread, out = in_thread(lambda: ps.pull(0, wait_for_newer=True, timeout=TIMEOUT * 10))
    thread.join(TIMEOUT)  # the slice, not the 300 s asked for
    assert not thread.is_alive() and out["result"] == (True, 0, {})
    assert ps.waiting_pulls == 0 and ps.pulls_told_not_yet == 0


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, 0.0])
def test_a_timeout_that_is_not_positive_waits_for_nothing(timeout):
    ps = make_ps(max_waiting_pulls=1, wait_slice=TIMEOUT * 10)
    thread, out = in_thread(lambda: ps.pull(0, wait_for_newer=True, timeout=timeout))
    thread.join(TIMEOUT)
    assert not thread.is_alive() and out["result"] == (True, 0, {})


def test_an_infinite_timeout_waits_one_slice():
    ps = make_ps(max_waiting_pulls=1, wait_slice=0.05)
    thread, out = in_thread(lambda: ps.pull(0, wait_for_newer=True, timeout=float("inf")))
    thread.join(TIMEOUT)
    assert not thread.is_alive() and out["result"] == (True, 0, {})


def test_waiting_pulls_take_a_small_share_of_the_server_threads():
    from elasticdl.ps import main

    assert 1 <= ps_server.MAX_WAITING_PULLS <= ps_server.SERVER_THREADS // 4
    assert ps_server.WAIT_SLICE_SECONDS <= 5
    assert "make_server(max_workers=SERVER_THREADS" in inspect.getsource(main.main)


# ---------------------------------------------------------------- over gRPC


class _Serving:
    """A real PS gRPC server in this process, with the PS's pool and wait slots (ps/main.py)."""

    def __init__(self, core: ParameterServer):
        self.core = core
        self.servicer = PServerServicer(core)
        self.arrived = _count_waiting_pulls(self.servicer)  # before add_service takes the methods
        self.server = grpc_utils.make_server(max_workers=ps_server.SERVER_THREADS)
        grpc_utils.add_service(self.server, "PServer", self.servicer)
        self.address = f"127.0.0.1:{grpc_utils.bind_local(self.server)}"
        self.server.start()

    def close(self):
        self.server.stop(grace=None)


@pytest.fixture
def serving():
    holder: list[_Serving] = []
    yield lambda core: holder.append(_Serving(core)) or holder[-1]
    for s in holder:
        s.close()


def _count_waiting_pulls(servicer: PServerServicer) -> list[int]:
    """Count the waiting pulls that reached the servicer (a server thread ran them)."""
    count, lock = [0], threading.Lock()
    for name in ("pull_dense_parameters", "pull_dense_parameters_stream"):
        original = getattr(servicer, name)

        def counted(request, context, original=original):
            if request.wait_for_newer:
                with lock:
                    count[0] += 1
            return original(request, context)

        setattr(servicer, name, counted)
    return count


def test_64_waiting_sync_pullers_leave_room_for_a_push_that_then_wakes_them(serving):
    """64 sync workers waiting for version 1 (as many as the PS's threads): the push that makes
    it goes through at once, and every waiter then gets version 1 and its parameters."""
    n = max(64, ps_server.SERVER_THREADS)  # every thread of the pool could be waiting
    ps = serving(make_ps(grads_to_wait=1))
    arrived = ps.arrived
    pullers = [PSClient([ps.address]) for _ in range(n)]
    pusher = PSClient([ps.address])
    pool, pool_for_push = ThreadPoolExecutor(max_workers=n), ThreadPoolExecutor(max_workers=1)
    try:
        waits = [pool.submit(client.pull, [0], [True], TIMEOUT) for client in pullers]
        # Every puller's waiting pull reached the PS (before the wait slots, 16 waited in the
        # 16 threads and the rest queued behind them for 30 s, with any push: the push took 90 s).
        assert eventually(lambda: arrived[0] >= n, timeout=10), f"only {arrived[0]} of {n} waiting pulls reached the PS"
        assert ps.core.waiting_pulls <= ps_server.MAX_WAITING_PULLS and ps.core.pulls_told_not_yet > 0
        assert not any(w.done() for w in waits)

        began = time.monotonic()
        # Promptly: 10 s is generous (it takes ms), and far below the pullers' 30 s.
        answer = pool_for_push.submit(pusher.push_gradients, {0: grad()}, [0], 0.5, worker_id=n).result(timeout=10)[0]
        pushed_in = time.monotonic() - began
        assert answer.applied and answer.version == 1

        for w in waits:
            (result,) = w.result(timeout=TIMEOUT)
            assert result.initialized and result.version == 1
            np.testing.assert_allclose(result.params["w"], np.full(3, -0.5, np.float32))
        woken_in = time.monotonic() - began
        print(f"\n{n} waiting pullers: push applied in {pushed_in * 1000:.1f} ms, "
              f"every waiter had version 1 {woken_in * 1000:.1f} ms after the push began")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        pool_for_push.shutdown(wait=False)
        for client in [*pullers, pusher]:
            client.close()


def test_a_client_polls_until_the_version_moves(serving):
    """No wait slot at all: the client's pull is answered "not yet" each time and asks again."""
    ps = serving(make_ps(grads_to_wait=1, max_waiting_pulls=0))
    puller, pusher = PSClient([ps.address]), PSClient([ps.address])
    try:
        thread, out = in_thread(lambda: puller.pull([0], [True], TIMEOUT))
        assert eventually(lambda: ps.core.pulls_told_not_yet >= 2)  # it asked again
        assert thread.is_alive()
        assert pusher.push_gradients({0: grad()}, [0], 0.5, worker_id=1)[0].applied
        thread.join(TIMEOUT)
        (result,) = out["result"]
        assert result.version == 1 and set(result.params) == {"w"}
    finally:
        puller.close()
        pusher.close()


def test_a_client_gives_up_at_its_timeout_with_the_same_version(serving):
    ps = serving(make_ps(grads_to_wait=1, max_waiting_pulls=0))
    puller = PSClient([ps.address])
    try:
        (result,) = puller.pull([0], [True], timeout=0.2)
        assert result.initialized and result.version == 0 and result.params == {}
        assert ps.core.pulls_told_not_yet >= 2
    finally:
        puller.close()
