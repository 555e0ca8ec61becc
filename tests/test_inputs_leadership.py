"""A master that cannot have a rival does not fence itself.

Without --etcd_endpoints the master keeps its state in its own in-memory store, which no
other process can reach: no other master can ever take its lock. A local master paused for
10 s (SIGSTOP) used to fail its job on waking, "lost the leader lock ... the in-memory state
store", because the lock's lease had expired by the clock meanwhile. A store that others can
reach (etcd; here a shared in-memory backend, which plays it in the contract tests) must still
step down: a rival may hold the lock by then.

The pause is a jump of an injected clock; the tests wait for the keepalive's next refresh,
an event, not for time.
"""

from __future__ import annotations

import threading

from elasticdl.store import MemoryBackend, MemoryStateStore
from elasticdl.store.ledger import LedgerSnapshot

TTL = 1
PAUSE = 10 * TTL + 1000.0  # far longer than the lease


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _refreshed_after_the_pause(store: MemoryStateStore, clock: _Clock) -> threading.Event:
    """Set once the keepalive refreshed the lease after the clock jumped."""
    refreshed = threading.Event()
    refresh = store._refresh

    def refresh_and_tell(lease_id: int) -> bool:
        alive = refresh(lease_id)
        if clock.now >= PAUSE:
            refreshed.set()
        return alive

    store._refresh = refresh_and_tell  # the keepalive thread calls the store's attribute
    return refreshed


def _paused_leader(store: MemoryStateStore, clock: _Clock):
    lost: list[str] = []
    lead = store.acquire_leadership("master-a", ttl=TTL, on_lost=lost.append)
    refreshed = _refreshed_after_the_pause(store, clock)
    clock.now += PAUSE  # the whole process stood still: no refresh ran meanwhile
    assert refreshed.wait(30.0), "the keepalive refreshes the lease again after the pause"
    return lead, lost


def test_the_masters_own_memory_store_cannot_have_a_rival():
    assert MemoryStateStore("job").backend.shared is False
    assert MemoryBackend().shared is True  # given to several stores (tests playing two masters)


def test_a_leader_on_its_own_memory_store_keeps_leading_after_a_long_pause():
    store = MemoryStateStore("job")
    clock = _Clock()
    store.backend.clock = clock
    try:
        lead, lost = _paused_leader(store, clock)
        assert lost == [] and lead.held and not lead.lost.is_set()
        revision = store.save_ledger(LedgerSnapshot(seq=1, epoch=0, num_epochs=1, next_task_id=0), 0)  # its fenced writes still go through
        assert store.load_ledger()[1] == revision
    finally:
        store.close()


def test_a_leader_on_a_store_others_reach_still_steps_down_after_a_long_pause():
    backend = MemoryBackend(clock=_Clock())
    store = MemoryStateStore("job", backend)
    try:
        lead, lost = _paused_leader(store, backend.clock)
        assert lead.lost.wait(30.0) and not lead.held
        assert len(lost) == 1 and lost[0].startswith("lost the leader lock /elasticdl/job/master")
        assert "its lease expired" in lost[0]
    finally:
        store.close()
