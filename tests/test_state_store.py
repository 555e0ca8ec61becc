"""The state store contract, on the in-memory store and on a real etcd (tests/etcd_fixture.py)."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid

import pytest

from elasticdl.master.ledger import (
    EpochRecord,
    LedgerFormatError,
    LedgerSnapshot,
    TaskRecord,
    TaskState,
    decode_rng_state,
    encode_rng_state,
)
from elasticdl.master.state_store import (
    EtcdStateStore,
    LeadershipError,
    LedgerConflictError,
    MemoryBackend,
    MemoryStateStore,
    ResilientStore,
    RetryPolicy,
    StoreUnavailableError,
    parse_endpoints,
)


def snap(seq: int, tasks: int = 4, epoch: int = 0, **changes) -> LedgerSnapshot:
    states = [TaskState.DONE, TaskState.DOING, TaskState.TODO, TaskState.DROPPED]
    records = tuple(
        TaskRecord(i, f"data/f{i % 2}.tfrecord", i * 10, i * 10 + 10, epoch, retries=i % 3,
                   state=states[i % 4], worker_id=1 if states[i % 4] is TaskState.DOING else -1)
        for i in range(tasks)
    )
    fields = dict(
        seq=seq, epoch=epoch, num_epochs=3, next_task_id=tasks, tasks=records,
        epochs=(EpochRecord(epoch, records_total=tasks * 10, records_done=10, records_duplicated=3,
                            tasks_done=1, tasks_retried=2),),
        job_fingerprint="digits-v1",
    )
    fields.update(changes)
    return LedgerSnapshot(**fields)


def wait_until(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture(params=["memory", "etcd"])
def make_store(request):
    """A factory of stores for one job: two calls are two masters of the same job."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    stores = []
    if request.param == "memory":
        backend = MemoryBackend()

        def make(**kwargs):
            stores.append(MemoryStateStore(job, backend, **kwargs))
            return stores[-1]
    else:
        endpoint = request.getfixturevalue("etcd_server")

        def make(**kwargs):
            stores.append(EtcdStateStore(endpoint, job, **kwargs))
            return stores[-1]

    yield make
    for store in stores:
        store.close()


# ---------------------------------------------------------------- the ledger itself


def test_snapshot_round_trips_through_json_and_bytes():
    s = snap(7, tasks=9, shuffle_state=encode_rng_state(random.Random(3).getstate()))
    assert LedgerSnapshot.from_json(s.to_json()) == s
    assert LedgerSnapshot.from_bytes(s.to_bytes()) == s
    rng = random.Random()
    rng.setstate(decode_rng_state(LedgerSnapshot.from_bytes(s.to_bytes()).shuffle_state))
    assert rng.random() == random.Random(3).random()


def test_requeue_in_flight_puts_doing_tasks_first_in_todo():
    s = snap(3, tasks=8)
    resumed = s.requeue_in_flight()
    assert not resumed.in_state(TaskState.DOING)
    todo = resumed.in_state(TaskState.TODO)
    assert [t.task_id for t in todo] == [1, 5, 2, 6]  # the in-flight ones first, then the queue
    assert all(t.worker_id == -1 for t in todo)
    assert [t.retries for t in todo[:2]] == [s.tasks[1].retries, s.tasks[5].retries]
    assert resumed.in_state(TaskState.DONE) == s.in_state(TaskState.DONE)
    assert resumed.seq == s.seq and resumed.next().seq == s.seq + 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "not JSON"),
        ('{"format": 99}', "format 99 is not supported"),
        ('{"format": 1, "seq": 1}', "malformed ledger snapshot"),
    ],
)
def test_bad_ledger_data_is_refused_with_a_reason(text, message):
    with pytest.raises(LedgerFormatError, match=message):
        LedgerSnapshot.from_json(text)


def test_a_task_with_an_unknown_state_is_refused():
    d = snap(1).to_dict()
    d["tasks"][0][6] = "lost"
    with pytest.raises(LedgerFormatError, match="'lost'"):
        LedgerSnapshot.from_dict(d)


def test_parse_endpoints():
    assert parse_endpoints("127.0.0.1:2379, http://etcd-0:12379/") == [("127.0.0.1", 2379), ("etcd-0", 12379)]
    assert parse_endpoints(["etcd"]) == [("etcd", 2379)]
    with pytest.raises(ValueError, match="TLS"):
        parse_endpoints("https://etcd:2379")
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoints("etcd:port")


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
    time.sleep(2.2)
    assert lead.held and not lead.lost.is_set()
    with pytest.raises(LeadershipError):
        b.acquire_leadership("master-b", ttl=1)


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
        from elasticdl.master.state_store import _Unavailable as lost
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


def test_a_large_ledger_goes_in_chunks_and_old_chunks_go(etcd_server):
    store = EtcdStateStore(etcd_server, f"job-{uuid.uuid4().hex[:8]}", chunk_bytes=2048)
    try:
        big = snap(1, tasks=3000)
        assert len(big.to_bytes()) > 3 * 2048
        revision = store.save_ledger(big, 0)
        assert store.load_ledger() == (big, revision)
        assert len(store._get_dir(store.chunks_dir)) > 3
        small = snap(2, tasks=2)
        revision = store.save_ledger(small, revision)
        assert store.load_ledger() == (small, revision)
        assert len(store._get_dir(store.chunks_dir)) == 1
        with pytest.raises(LedgerConflictError):  # a refused big write leaves no chunks behind
            store.save_ledger(snap(3, tasks=3000), revision - 1)
        assert len(store._get_dir(store.chunks_dir)) == 1
    finally:
        store.close()


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


@pytest.fixture(params=["memory", "etcd"])
def outage(request):
    """(store factory, take the store down, bring it back)."""
    job = f"job-{uuid.uuid4().hex[:8]}"
    if request.param == "memory":
        backend = MemoryBackend()

        def down():
            backend.available = False

        def up():
            backend.available = True

        yield (lambda: MemoryStateStore(job, backend)), down, up
    else:
        etcd = request.getfixturevalue("etcd_process")
        yield (lambda: EtcdStateStore(etcd.endpoint, job)), etcd.kill, etcd.start


def test_the_master_rides_out_an_outage_and_resyncs_the_newest_ledger(outage, caplog):
    make, down, up = outage
    caplog.set_level(logging.WARNING, logger="elasticdl.master.state_store")
    store = make()
    lead = store.acquire_leadership("master-a", ttl=3)
    seen = []
    ledger = ResilientStore(store, on_outage=seen.append)
    try:
        assert ledger.load_ledger() is None
        assert ledger.save(snap(1)) is True

        down()
        assert ledger.save(snap(2)) is False  # waits for one write attempt, then serves from memory
        assert ledger.in_outage
        started = time.monotonic()
        assert ledger.save(snap(3, tasks=6)) is False
        assert ledger.save(snap(2)) is False  # older than what the master holds: dropped
        assert time.monotonic() - started < 0.2  # no waiting during an outage
        assert ledger.pending_seq == 3 and ledger.persisted_seq == 1
        time.sleep(0.6)

        up()
        assert ledger.flush(15.0)
        assert not ledger.in_outage and ledger.persisted_seq == 3
        assert len(seen) == 1 and seen[0].seconds >= 0.6 and seen[0].snapshots_kept >= 1
        unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
        back = [r for r in caplog.records if "reachable again after an outage of" in r.getMessage()]
        assert len(unreachable) == 1 and len(back) == 1
        assert "wrote ledger seq 3" in back[0].getMessage()

        fresh = make()
        loaded, revision = fresh.load_ledger()
        assert loaded == snap(3, tasks=6) and revision == ledger.revision
        assert ledger.save(snap(4)) is True  # business as usual
        assert lead.held
        fresh.close()
    finally:
        ledger.close()
        store.close()


def test_a_conflict_stops_the_resilient_writer(make_store):
    a, b = make_store(), make_store()
    fatal = []
    ledger = ResilientStore(a, on_fatal=fatal.append)
    try:
        assert ledger.load_ledger() is None
        assert ledger.save(snap(1))
        _, revision = b.load_ledger()
        b.save_ledger(snap(7), revision)  # another master
        with pytest.raises(LedgerConflictError, match="another master wrote it"):
            ledger.save(snap(2))
        assert len(fatal) == 1
        with pytest.raises(LedgerConflictError):
            ledger.save(snap(3))
        assert b.load_ledger()[0].seq == 7
    finally:
        ledger.close(flush_timeout=0)


def test_save_before_load_is_refused():
    with pytest.raises(RuntimeError, match="load_ledger"):
        ResilientStore(MemoryStateStore("job")).save(snap(1))
