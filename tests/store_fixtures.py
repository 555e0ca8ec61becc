"""Stores of both kinds for the state store tests, as fixtures.

``make_store`` and ``outage`` are parametrized over the in-memory store and a real etcd
(tests/etcd_fixture.py), so every test taking them runs on both. A test module loads them
with ``pytest_plugins = ["store_fixtures"]``.
"""

from __future__ import annotations

import uuid

import pytest

from elasticdl.store import EtcdStateStore, MemoryBackend, MemoryStateStore


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
