"""The state store contract (elasticdl/store/api.py), on the in-memory store and on a real etcd.

Every test taking ``make_store`` runs twice: on :class:`MemoryStateStore` (the master's
embedded default) and on :class:`EtcdStateStore` against a real etcd (tests/etcd_fixture.py).
"""

from __future__ import annotations

import threading
import time

import pytest
from store_helpers import snap, wait_until

from elasticdl.store import (
    EtcdStateStore,
    LeadershipError,
    LedgerConflictError,
    MemoryBackend,
    MemoryStateStore,
    RetryPolicy,
    StoreUnavailableError,
)

pytest_plugins = ["store_fixtures"]  # make_store: on memory and on etcd


# ---------------------------------------------------------------- leader lock


def test_a_second_master_is_refused_naming_the_first(make_store):
    a, b = make_store(), make_store()
    with a.acquire_leadership("master-a", ttl=5):
        with pytest.raises(LeadershipError) as refused:
            b.acquire_leadership("master-b", ttl=5, wait=False)
        assert str(refused.value).startswith(
            f"another master (owner 'master-a') holds /elasticdl/{a.job_name}/master; stop it or wait"
        )
        started = time.monotonic()
        with pytest.raises(LeadershipError, match="still held after waiting"):
            b.acquire_leadership("master-b", ttl=5, wait=0.4)
        assert 0.35 < time.monotonic() - started < 3


def test_a_waiting_master_takes_over_when_the_first_releases(make_store):
    a, b = make_store(), make_store()
    first = a.acquire_leadership("master-a", ttl=5)
    threading.Timer(0.3, first.release).start()
    started = time.monotonic()
    second = b.acquire_leadership("master-b", ttl=5, wait=5.0)
    assert second.held and not first.held
    assert 0.25 < time.monotonic() - started < 3


def test_the_lock_frees_when_its_holder_dies_and_fences_it_out(make_store):
    a, b = make_store(), make_store()
    first = a.acquire_leadership("master-a", ttl=1)
    revision = a.save_ledger(snap(1), 0)
    first._abandon()  # a crash: the lease is no longer refreshed
    started = time.monotonic()
    second = b.acquire_leadership("master-b", ttl=5, wait=6.0)
    assert second.held and time.monotonic() - started < 4
    # The old master comes back to life: its writes are refused.
    with pytest.raises(LeadershipError, match=r"no longer holds .*\(now held by 'master-b'\)"):
        a.save_ledger(snap(2), revision)
    assert b.load_ledger()[0].seq == 1


def test_a_live_master_keeps_its_lock_beyond_the_ttl(make_store):
    a, b = make_store(), make_store()
    lead = a.acquire_leadership("master-a", ttl=1)
    time.sleep(2.2)  # the duration under test (longer than the ttl), not a timing window: cannot race
    assert lead.held and not lead.lost.is_set()
    with pytest.raises(LeadershipError):
        b.acquire_leadership("master-b", ttl=1)

def test_a_lost_lease_calls_on_lost_and_fences_the_master_out(make_store):
    a, b = make_store(), make_store()
    lost = []
    lead = a.acquire_leadership("master-a", ttl=1, on_lost=lost.append)
    revision = a.save_ledger(snap(1), 0)
    b._revoke(lead.lease_id)  # the lease is gone while master-a still runs (it was cut off too long)
    wait_until(lambda: lost, 3.0, "on_lost is called")
    assert lead.lost.is_set() and not lead.held
    assert len(lost) == 1 and lost[0].startswith(f"lost the leader lock /elasticdl/{a.job_name}/master")
    with pytest.raises(LeadershipError, match="nobody holds it now"):
        a.save_ledger(snap(2), revision)
    second = b.acquire_leadership("master-b", ttl=5)  # the lock is free at once
    assert second.held
    with pytest.raises(LeadershipError, match=r"now held by 'master-b'"):
        a.save_ledger(snap(2), revision)
    assert b.load_ledger() == (snap(1), revision)
    lead.release()  # releasing a lost lock is harmless
    assert second.held and len(lost) == 1


def test_one_store_holds_the_lock_once(make_store):
    store = make_store()
    lead = store.acquire_leadership("m", ttl=5)
    assert store.leadership is lead
    with pytest.raises(LeadershipError, match="this store already holds"):
        store.acquire_leadership("m", ttl=5)
    with pytest.raises(ValueError, match="ttl must be positive"):
        make_store().acquire_leadership("m", ttl=0)


def test_releasing_the_store_frees_the_lock_and_withdraws_its_addresses(make_store):
    master, observer = make_store(), make_store()
    master.acquire_leadership("master-a", ttl=5)
    master.publish_address("master", 0, "10.0.0.5:50001")
    master.publish_address("worker", 3, "10.0.0.6:7000")
    assert observer.master_address() == "10.0.0.5:50001"
    assert observer.addresses("worker") == {3: "10.0.0.6:7000"}
    master.release()
    assert master.leadership is None
    assert observer.master_address() is None and observer.addresses("worker") == {}
    assert observer.acquire_leadership("master-b", ttl=5).held


# ---------------------------------------------------------------- ledger


def test_ledger_round_trip(make_store):
    store = make_store()
    store.acquire_leadership("m", ttl=5)
    assert store.load_ledger() == (None, 0)
    first = store.save_ledger(snap(1), 0)
    assert first > 0
    second = store.save_ledger(snap(2, tasks=6), first)
    assert second > first
    loaded, revision = make_store().load_ledger()
    assert (loaded, revision) == (snap(2, tasks=6), second)
    store.clear_ledger()
    assert store.load_ledger() == (None, 0)


def test_compare_and_set_refuses_a_stale_revision(make_store):
    a, b = make_store(), make_store()
    rev_a = a.save_ledger(snap(1), 0)
    with pytest.raises(LedgerConflictError, match="changed since revision 0"):
        b.save_ledger(snap(5), 0)  # b thinks the job is new
    _, rev_b = b.load_ledger()
    rev_b = b.save_ledger(snap(2), rev_b)
    with pytest.raises(LedgerConflictError) as conflict:
        a.save_ledger(snap(3), rev_a)
    assert conflict.value.current_revision == rev_b and conflict.value.stored_seq == 2
    assert a.load_ledger() == (snap(2), rev_b)


def test_an_older_snapshot_never_replaces_a_newer_one(make_store):
    store = make_store()
    revision = store.save_ledger(snap(5), 0)
    for older in (snap(4), snap(5), snap(5, tasks=6)):
        with pytest.raises(LedgerConflictError, match=f"seq {older.seq}: the stored ledger is at seq 5"):
            store.save_ledger(older, revision)
    assert store.load_ledger() == (snap(5), revision)


def _lose_replies(store, times: int) -> None:
    """The next ``times`` ledger writes are applied, but their replies are lost."""
    write = store._write_ledger
    if isinstance(store, EtcdStateStore):
        from pyetcd.exceptions import ConnectionTimeoutError as lost
    else:
        from elasticdl.store.memory import _Unavailable as lost
    left = [times]

    def applied_then_lost(*args):
        revision = write(*args)
        if left[0] > 0:
            left[0] -= 1
            raise lost()
        return revision

    store._write_ledger = applied_then_lost


def test_a_write_whose_reply_was_lost_is_not_a_conflict(make_store):
    store = make_store()
    revision = store.save_ledger(snap(1), 0)
    _lose_replies(store, 1)
    revision = store.save_ledger(snap(2), revision)  # retried: finds its own write
    assert store.load_ledger() == (snap(2), revision)
    # Lost for good (no retry budget), then the next snapshot goes on from the landed one.
    _lose_replies(store, 1)
    with pytest.raises(StoreUnavailableError):
        store.save_ledger(snap(3), revision, retry=RetryPolicy(budget=0))
    revision = store.save_ledger(snap(4), revision)
    assert store.load_ledger() == (snap(4), revision)
    # Someone else's write is still a conflict.
    other = make_store()
    other.save_ledger(snap(9), revision)
    with pytest.raises(LedgerConflictError, match="another master wrote it"):
        store.save_ledger(snap(10), revision)


# ---------------------------------------------------------------- addresses


def test_addresses_live_with_their_lease(make_store):
    ps_store, master = make_store(), make_store()
    keeper = ps_store.publish_address("ps", 0, "127.0.0.1:5000", ttl=1)
    crashed = ps_store.publish_address("ps", 1, "127.0.0.1:5001", ttl=1)
    assert master.addresses("ps") == {0: "127.0.0.1:5000", 1: "127.0.0.1:5001"}
    crashed._abandon()
    waited = wait_until(lambda: 1 not in master.addresses("ps"), 4.0, "a dead PS's address expires")
    assert waited > 0.5
    assert master.addresses("ps") == {0: "127.0.0.1:5000"}  # kept alive past its ttl
    keeper.revoke()
    assert master.addresses("ps") == {}


def test_the_master_address_goes_with_the_leader(make_store):
    master, worker = make_store(), make_store()
    assert worker.master_address() is None
    lead = master.acquire_leadership("m", ttl=5)
    master.publish_address("master", 0, "10.0.0.5:50001")
    assert worker.master_address() == "10.0.0.5:50001"
    lead.release()
    assert worker.master_address() is None

def test_an_address_whose_lease_expired_is_published_again(make_store):
    ps_store, master = make_store(), make_store()
    registration = ps_store.publish_address("ps", 0, "127.0.0.1:5000", ttl=1)
    old = registration.lease_id
    master._revoke(old)  # the lease is gone while the PS still runs
    assert master.addresses("ps") == {}
    wait_until(lambda: master.addresses("ps") == {0: "127.0.0.1:5000"}, 3.0, "the PS publishes again")
    assert registration.lease_id != old
    registration.revoke()
    assert master.addresses("ps") == {}


def test_keys_and_names_are_checked(make_store):
    store = make_store()
    assert store.address_key("ps", 2) == f"/elasticdl/{store.job_name}/addresses/ps/2"
    with pytest.raises(ValueError, match="role must be non-empty"):
        store.publish_address("a/b", 0, "x:1")
    with pytest.raises(ValueError, match="job name must be non-empty"):
        MemoryStateStore("a/b")
    if isinstance(store, EtcdStateStore):
        assert store.persistent and store.describe().startswith("etcd at 127.0.0.1:")
    else:
        assert not store.persistent and store.describe() == "the in-memory state store"


# ---------------------------------------------------------------- outages


def test_calls_give_up_after_the_retry_budget(tmp_path):
    backend = MemoryBackend()
    backend.available = False
    memory = MemoryStateStore("job", backend, retry=RetryPolicy(budget=0.3))
    with _closed_port() as port:
        etcd = EtcdStateStore(f"127.0.0.1:{port}", "job", retry=RetryPolicy(budget=0.3))
        for store in (memory, etcd):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="is unreachable: could not read the ledger"):
                store.load_ledger()
            assert time.monotonic() - started < 2
        etcd.close()


class _closed_port:
    """A loopback port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        return self._sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self._sock.close()


# ---------------------------------------------------------------- the package


def test_the_store_imports_no_role():
    """master, ps and worker all use the store; it must not use any of them (nor the CLI)."""
    import ast
    import pathlib
    import subprocess
    import sys

    import elasticdl.store

    forbidden = ("elasticdl.master", "elasticdl.ps", "elasticdl.worker", "elasticdl.cli", "elasticdl.api")
    package = pathlib.Path(elasticdl.store.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, elasticdl.store; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert not [m for m in loaded if m.startswith(forbidden)]
    assert not {"pyetcd", "etcd3", "grpc"} & set(loaded)  # the etcd client comes with the first EtcdStateStore


def test_a_leader_that_cannot_renew_stops_acting_before_its_lease_can_expire(outage):
    """client-go's renew deadline: the leader gives up while its lease is still alive, so no
    other master can hold the lock while this one still acts."""
    from elasticdl.store.leadership import RENEW_DEADLINE_SHARE

    make, down, up = outage
    store = make()
    lost: list[str] = []
    lead = store.acquire_leadership("master-a", ttl=3, on_lost=lost.append)
    try:
        down()
        wait_until(lambda: lost, 6.0, "the leader gives up")
        unrenewed = time.monotonic() - lead._keepalive.last_renewed
        assert lead.lost.is_set() and not lead.held
        assert "could not renew its lease" in lost[0] and "stops acting" in lost[0]
        assert 3 * RENEW_DEADLINE_SHARE <= unrenewed < 3, "it gave up after the deadline, before the ttl"
    finally:
        up()
    assert len(lost) == 1


def test_an_address_with_on_lost_reports_its_lost_lease_instead_of_publishing_again(make_store):
    """A PS registers with ``on_lost`` (ps/main.py): a lease it cannot keep ends the PS, the
    seed design's rule, instead of a second life under a new lease."""
    ps_store, master = make_store(), make_store()
    lost: list[str] = []
    registration = ps_store.publish_address("ps", 0, "127.0.0.1:5000", ttl=1, on_lost=lost.append)
    master._revoke(registration.lease_id)
    wait_until(lambda: lost, 3.0, "the PS hears its lease is gone")
    assert master.addresses("ps") == {}  # not published again
    registration._abandon()
