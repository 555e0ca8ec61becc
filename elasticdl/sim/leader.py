"""The master's leader lock in the etcd-like store, kept alive from the master's own loop.

It mirrors elasticdl/store/leadership.py (``acquire_leadership`` and ``_KeepAlive``) on the
same store primitives (``_grant``, ``_try_lead``, ``_refresh``), without its thread: the lock's
create revision is the master's term (its fencing token), the lease is refreshed every ttl/3,
and a master that could not renew within the renew deadline (2/3 of the ttl) stops acting, so
that no other master can lead while it still acts.
"""

from __future__ import annotations

import json

from elasticdl.sim.scheduler import Sleep
from elasticdl.store.errors import StateStoreError
from elasticdl.store.leadership import RENEW_DEADLINE_SHARE, RETRY_SECONDS
from elasticdl.store.memory import MemoryStateStore

LEASE_TTL = 10  # elasticdl/master/job_state.py LEADER_LEASE_SECS


class SimLeadership:
    def __init__(self, store: MemoryStateStore, owner: str, clock) -> None:
        self.store = store
        self.owner = owner
        self.clock = clock
        self.lease = 0
        self.term = 0
        self._renewed = 0.0  # the last successful refresh
        self._tried = 0.0  # the last attempt

    def acquire(self):
        """Coroutine: wait (as long as it takes) for the lock; the term."""
        value = json.dumps({"owner": self.owner, "ttl": LEASE_TTL}).encode()
        while True:
            try:
                if not self.lease or not self.store._refresh(self.lease):
                    self.lease = self.store._grant(LEASE_TTL)
                revision, _ = self.store._try_lead(value, self.lease)
                if revision:
                    break
            except (StateStoreError, ConnectionError):
                pass  # the store is cut off: ask again
            yield Sleep(0.2)
        self.term = revision
        self.store._fence = revision  # ledger writes compare the lock's revision, as after acquire_leadership
        self._renewed = self._tried = self.clock()
        return revision

    def keep_alive(self) -> bool:
        """Called at every poll of the master: refresh when due; False once it must stop acting."""
        now = self.clock()
        due = LEASE_TTL / 3.0 if self._tried == self._renewed else RETRY_SECONDS
        if now - self._tried >= due:
            self._tried = now
            try:
                if not self.store._refresh(self.lease):
                    return False  # the lease expired: another master may lead
                self._renewed = now
            except (StateStoreError, ConnectionError):
                pass
        return now - self._renewed <= LEASE_TTL * RENEW_DEADLINE_SHARE

    def holds(self) -> bool:
        """The store's view (for the invariant): the lock is this master's and its lease alive."""
        backend = self.store.backend
        entry = backend.kv.get(self.store.master_key)
        lease = backend.leases.get(self.lease)
        return entry is not None and entry[1] == self.lease and lease is not None and lease[1] > self.clock()
