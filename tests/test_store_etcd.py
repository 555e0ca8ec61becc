"""What only the etcd store does (elasticdl/store/etcd.py): endpoints and chunked ledgers."""

from __future__ import annotations

import uuid

import pytest
from store_helpers import snap

from elasticdl.store import EtcdStateStore, LedgerConflictError, parse_endpoints


def test_parse_endpoints():
    assert parse_endpoints("127.0.0.1:2379, http://etcd-0:12379/") == [("127.0.0.1", 2379), ("etcd-0", 12379)]
    assert parse_endpoints(["etcd"]) == [("etcd", 2379)]
    with pytest.raises(ValueError, match="TLS"):
        parse_endpoints("https://etcd:2379")
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoints("etcd:port")


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
