"""The embedded default store: process memory, nothing outlives the master.

:class:`MemoryStateStore` implements the whole :class:`~elasticdl.store.api.StateStore`
contract -- leader lock with ``on_lost`` and fencing, compare-and-set ledger, addresses on
leases -- on a :class:`MemoryBackend`, a small key-value store with leases and revisions
like etcd's. So the master has one code path with or without etcd, and the contract tests
run on both. Stores given the same backend see one another (two masters of one job, a
master and a PS); ``backend.available = False`` plays an outage.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from elasticdl.store.api import (
    _SEQ_DIGITS,
    CHUNK_BYTES,
    StateStore,
    _CasFailed,
    _head_json,
    _join_chunks,
    _owner,
    _seq_bytes,
    _split,
)
from elasticdl.store.errors import LeadershipError, RetryPolicy, StateStoreError


class _Unavailable(ConnectionError):
    pass


class MemoryBackend:
    """What :class:`MemoryStateStore` instances share: a small key-value store with leases
    and revisions, like etcd's. Each store gets its own unless given one (tests share one
    to play two masters). Set ``available = False`` to play an outage.

    ``shared=False``: no other store will ever use this backend (the master's own, without
    --etcd_endpoints). No rival can then take a lease over, so leases do not expire: a master
    paused for longer than its ttl (SIGSTOP, a swapped-out host) keeps leading when it wakes,
    instead of fencing itself against a rival that cannot exist.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, shared: bool = True):
        self.clock = clock
        self.shared = shared
        self.available = True
        self.lock = threading.Lock()
        self.revision = 0
        # key -> (value, lease, create revision, mod revision)
        self.kv: dict[str, tuple[bytes, int, int, int]] = {}
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expires at)
        self._next_lease = 1

    def check(self) -> None:
        """Call under ``lock``: raise during an outage, expire leases."""
        if not self.available:
            raise _Unavailable("the in-memory store is unavailable (simulated outage)")
        if not self.shared:
            return  # leases expire so that a rival may take over; there is none
        now = self.clock()
        for lease_id, (_, expires) in list(self.leases.items()):
            if expires <= now:
                del self.leases[lease_id]
                for key in [k for k, v in self.kv.items() if v[1] == lease_id]:
                    del self.kv[key]
                    self.revision += 1

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self.revision += 1
        old = self.kv.get(key)
        self.kv[key] = (value, lease, old[2] if old else self.revision, self.revision)
        return self.revision


class MemoryStateStore(StateStore):
    """The default store: process memory; nothing outlives the master."""

    def __init__(self, job_name: str, backend: MemoryBackend | None = None, retry: RetryPolicy | None = None):
        super().__init__(job_name, retry)
        self.backend = backend or MemoryBackend(shared=False)  # its own: no rival can reach it

    def describe(self) -> str:
        return "the in-memory state store"

    @property
    def persistent(self) -> bool:
        return False

    def _is_transient(self, error: Exception) -> bool:
        return isinstance(error, _Unavailable)

    def _grant(self, ttl: int) -> int:
        b = self.backend
        with b.lock:
            b.check()
            lease_id, b._next_lease = b._next_lease, b._next_lease + 1
            b.leases[lease_id] = (ttl, b.clock() + ttl)
            return lease_id

    def _refresh(self, lease_id: int) -> bool:
        b = self.backend
        with b.lock:
            b.check()
            if lease_id not in b.leases:
                return False
            ttl = b.leases[lease_id][0]
            b.leases[lease_id] = (ttl, b.clock() + ttl)
            return True

    def _revoke(self, lease_id: int) -> None:
        b = self.backend
        with b.lock:
            b.check()
            if b.leases.pop(lease_id, None) is not None:
                for key in [k for k, v in b.kv.items() if v[1] == lease_id]:
                    del b.kv[key]
                    b.revision += 1

    def _try_lead(self, value: bytes, lease_id: int) -> tuple[int, str]:
        b = self.backend
        with b.lock:
            b.check()
            current = b.kv.get(self.master_key)
            if current is None:
                if lease_id not in b.leases:
                    raise LeadershipError("the lease for the leader lock expired before it was taken")
                b.put(self.master_key, value, lease_id)
                current = b.kv[self.master_key]
            return (current[2] if current[1] == lease_id else 0), _owner(current[0])

    def _put(self, key: str, value: bytes, lease_id: int | None) -> None:
        b = self.backend
        with b.lock:
            b.check()
            if lease_id and lease_id not in b.leases:
                raise StateStoreError(f"lease {lease_id:x} not found")
            b.put(key, value, lease_id or 0)

    def _delete(self, key: str) -> None:
        b = self.backend
        with b.lock:
            b.check()
            if b.kv.pop(key, None) is not None:
                b.revision += 1

    def _get_dir(self, prefix: str) -> dict[str, bytes]:
        b = self.backend
        with b.lock:
            b.check()
            return {k: v[0] for k, v in b.kv.items() if k.startswith(prefix)}

    def _delete_dir(self, prefix: str) -> None:
        b = self.backend
        with b.lock:
            b.check()
            for key in [k for k in b.kv if k.startswith(prefix)]:
                del b.kv[key]
            b.revision += 1

    def _write_ledger(self, data: bytes, seq: int, expected_revision: int, fence: int | None) -> int:
        b = self.backend
        with b.lock:
            b.check()
            head = b.kv.get(self.head_key)
            stored = b.kv.get(self.seq_key)
            lock = b.kv.get(self.master_key)
            head_rev = head[3] if head else 0
            stored_seq = int(stored[0]) if stored else -1
            fenced_out = fence is not None and (lock is None or lock[2] != fence)
            if fenced_out or head_rev != expected_revision or stored_seq >= seq:
                info = json.loads(head[0]) if head else {}
                raise _CasFailed(head_rev, stored_seq, info.get("writer", ""), fenced_out,
                                 _owner(lock[0]) if lock else "", info.get("crc32", -1))
            chunks = f"{self.chunks_dir}{seq:0{_SEQ_DIGITS}d}-{self.writer_id}/"
            for key in [k for k in b.kv if k.startswith(self.chunks_dir)]:
                del b.kv[key]
            b.revision += 1
            rev = b.revision
            for i, part in enumerate(_split(data, CHUNK_BYTES)):
                b.kv[f"{chunks}{i:06d}"] = (part, 0, rev, rev)
            count = len(_split(data, CHUNK_BYTES))
            b.kv[self.head_key] = (_head_json(seq, self.writer_id, chunks, count, data), 0,
                                   head[2] if head else rev, rev)
            b.kv[self.seq_key] = (_seq_bytes(seq), 0, stored[2] if stored else rev, rev)
            return rev

    def _read_ledger(self) -> tuple[bytes | None, int]:
        b = self.backend
        with b.lock:
            b.check()
            head = b.kv.get(self.head_key)
            if head is None:
                return None, 0
            info = json.loads(head[0])
            chunks = [b.kv.get(f"{info['chunks']}{i:06d}", (None,))[0] for i in range(info["count"])]
            return _join_chunks(info, chunks), head[3]
