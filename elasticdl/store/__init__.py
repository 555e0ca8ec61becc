"""Where a job keeps what must outlive its processes: leader lock, task ledger, addresses.

Usage::

    from elasticdl import store

    s = store.EtcdStateStore("127.0.0.1:2379", "my-job")     # or store.MemoryStateStore("my-job")
    lead = s.acquire_leadership("host:1234", ttl=10, on_lost=print)
    ledger = store.ResilientStore(s)                         # rides out outages
    snapshot = ledger.load_ledger()                          # None for a new job

One concept per module:

- :mod:`~elasticdl.store.api`: the contract (:class:`StateStore`), its key layout and
  compare-and-set rules;
- :mod:`~elasticdl.store.errors`: the exception tree and :class:`RetryPolicy`;
- :mod:`~elasticdl.store.leadership`: leases kept alive (:class:`Leadership`,
  :class:`Registration`);
- :mod:`~elasticdl.store.ledger`: the task ledger's value types (:class:`LedgerSnapshot`);
- :mod:`~elasticdl.store.memory`: the embedded default (:class:`MemoryStateStore`);
- :mod:`~elasticdl.store.etcd`: etcd v3 (:class:`EtcdStateStore`);
- :mod:`~elasticdl.store.write_behind`: :class:`ResilientStore` and :class:`Outage`.

The package imports nothing of the master, the PS, the worker or the CLI, so any of them
may use it. The etcd client is imported only when an :class:`EtcdStateStore` is created.
"""

from elasticdl.store.api import CHUNK_BYTES, DEFAULT_LEASE_TTL, ROOT, StateStore
from elasticdl.store.errors import (
    LeadershipError,
    LedgerConflictError,
    RetryPolicy,
    StateStoreError,
    StoreUnavailableError,
)
from elasticdl.store.etcd import EtcdStateStore, parse_endpoints
from elasticdl.store.leadership import Leadership, Registration
from elasticdl.store.ledger import (
    EpochRecord,
    LedgerFormatError,
    LedgerSnapshot,
    TaskRecord,
    TaskState,
    decode_rng_state,
    encode_rng_state,
)
from elasticdl.store.memory import MemoryBackend, MemoryStateStore
from elasticdl.store.write_behind import Outage, ResilientStore

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_LEASE_TTL",
    "ROOT",
    "EpochRecord",
    "EtcdStateStore",
    "Leadership",
    "LeadershipError",
    "LedgerConflictError",
    "LedgerFormatError",
    "LedgerSnapshot",
    "MemoryBackend",
    "MemoryStateStore",
    "Outage",
    "Registration",
    "ResilientStore",
    "RetryPolicy",
    "StateStore",
    "StateStoreError",
    "StoreUnavailableError",
    "TaskRecord",
    "TaskState",
    "decode_rng_state",
    "encode_rng_state",
    "parse_endpoints",
]
