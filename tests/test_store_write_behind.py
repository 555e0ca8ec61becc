"""The write-behind ledger writer (elasticdl/store/write_behind.py): outages and conflicts,
on the in-memory store and on a real etcd."""

from __future__ import annotations

import logging
import time

import pytest
from store_helpers import snap

from elasticdl.store import LedgerConflictError, MemoryStateStore, ResilientStore

pytest_plugins = ["store_fixtures"]  # make_store, outage: on memory and on etcd


def test_the_master_rides_out_an_outage_and_resyncs_the_newest_ledger(outage, caplog):
    make, down, up = outage
    caplog.set_level(logging.WARNING, logger="elasticdl.store")
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
        (ongoing,) = ledger.outages_so_far  # listed while it lasts, not only once it ended
        assert ongoing.ongoing and ongoing.error and ledger.outages == []
        time.sleep(0.6)  # an outage at least this long (asserted below); no window to hit, cannot race

        up()
        assert ledger.flush(15.0)
        assert not ledger.in_outage and ledger.persisted_seq == 3
        assert len(seen) == 1 and seen[0].seconds >= 0.6 and seen[0].snapshots_kept >= 1
        assert ledger.outages_so_far == seen and not seen[0].ongoing
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
