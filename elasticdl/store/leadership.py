"""Leases kept alive: the job's leader lock and the addresses that live with their process.

A :class:`Leadership` is the leader lock held on a lease; a :class:`Registration` is an
address published on a lease. Each has a thread (:class:`_KeepAlive`) refreshing the lease
every ttl/3. When the lease is gone anyway (the process was cut off from the store for
longer than the ttl while the store kept running), a leadership is *lost* (``on_lost``:
another master may lead now) and a registration publishes its address again. On a store no
other process can reach (the master's own in-memory store, without --etcd_endpoints) there is
no other master: its leases do not expire, so a paused master never fences itself
(``MemoryBackend.shared``).

Both are made by a :class:`~elasticdl.store.api.StateStore`
(``acquire_leadership``, ``publish_address``) and use only its backend primitives
(``_grant``, ``_refresh``, ``_revoke``, ``_put``, ``_delete``, ``_call``), so they work the
same on every backend.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elasticdl.store.errors import StateStoreError

if TYPE_CHECKING:
    from elasticdl.store.api import StateStore

logger = logging.getLogger(__name__)


def _lease_seconds(ttl: float) -> int:
    """etcd leases count whole seconds."""
    if ttl <= 0:
        raise ValueError(f"a lease ttl must be positive. Received: ttl={ttl}")
    return max(1, math.ceil(ttl))



# A failing refresh is tried again this often (a lease outlives a short outage only if it is
# renewed soon after the store answers again).
RETRY_SECONDS = 0.5
# The leader must have renewed its lease within this share of the ttl, or it stops acting: the
# lease cannot have expired yet, so no other master can lead while this one still acts.
RENEW_DEADLINE_SHARE = 2 / 3


class _KeepAlive:
    """Refreshes a lease every ttl/3 until stopped; says when the lease is gone.

    With ``renew_deadline``, ``on_lost`` is also called once no refresh succeeded for that
    long (client-go leader election's renew deadline): the lease may still be alive, but it
    can expire before the store answers again.
    """

    def __init__(self, store: StateStore, lease_id: int, ttl: int, what: str, on_lost: Callable[[str], None],
                 renew_deadline: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._store = store
        self.lease_id = lease_id
        self._interval = max(ttl / 3.0, 0.05)
        self._what = what
        self._on_lost = on_lost
        self._renew_deadline = renew_deadline
        self._clock = clock
        self.last_renewed = clock()  # the lease was granted or refreshed just now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keepalive {what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        failing_since = None
        wait = self._interval
        while not self._stop.wait(wait):
            try:
                alive = self._store._refresh(self.lease_id)
            except Exception as e:  # noqa: BLE001 - a keepalive thread must not die of an outage
                if failing_since is None:
                    failing_since = self._clock()
                    logger.warning("cannot refresh the lease of %s (%s); retrying every %.1fs",
                                   self._what, e, min(self._interval, RETRY_SECONDS))
                wait = min(self._interval, RETRY_SECONDS)
                unrenewed = self._clock() - self.last_renewed
                if self._renew_deadline is not None and unrenewed >= self._renew_deadline:
                    self._on_lost(f"could not renew its lease for {unrenewed:.1f}s "
                                  f"(renew deadline {self._renew_deadline:.1f}s; last error: {e})")
                    return
                continue
            wait = self._interval
            if failing_since is not None:
                logger.info("lease of %s refreshed again after %.1fs", self._what, self._clock() - failing_since)
                failing_since = None
            if not alive:
                self._on_lost("its lease expired while the store could not be reached")
                if self._stop.is_set():
                    return
                continue
            self.last_renewed = self._clock()


class Leadership:
    """The job's leader lock, held through a lease that a thread keeps alive.

    ``lost`` is set when the lease expired anyway (this master was cut off from etcd for
    longer than ``ttl`` while etcd kept running): another master may lead now, so this one
    must stop handing out tasks. Release it with :meth:`release` (or ``with``).
    """

    def __init__(self, store: StateStore, owner: str, ttl: int, lease_id: int, revision: int,
                 on_lost: Callable[[str], None] | None):
        self.store = store
        self.owner = owner
        self.ttl = ttl
        self.lease_id = lease_id
        self.revision = revision  # create revision of the lock key: the fencing token
        self.key = store.master_key
        self.lost = threading.Event()
        self._released = False
        self._on_lost = on_lost
        self._keepalive = _KeepAlive(store, lease_id, ttl, f"the leader lock {self.key}", self._lease_lost,
                                     renew_deadline=ttl * RENEW_DEADLINE_SHARE)

    @property
    def held(self) -> bool:
        return not self._released and not self.lost.is_set()

    def _lease_lost(self, why: str) -> None:
        self._keepalive._stop.set()
        message = (f"lost the leader lock {self.key}: {why} ({self.store.describe()}); another master "
                   "may take over, so this one stops acting")
        logger.error(message)
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost(message)

    def release(self) -> None:
        """Give the lock up now (the next master need not wait for the lease to expire)."""
        if self._released:
            return
        self._released = True
        self._keepalive.stop()
        try:
            self.store._call("release the leader lock", self.store._revoke, self.lease_id)
        except StateStoreError as e:
            logger.warning("could not release %s (%s); it expires within %ds", self.key, e, self.ttl)

    def _abandon(self) -> None:
        """Stop refreshing without releasing, as a crashed master would (tests)."""
        self._keepalive.stop()

    def __enter__(self) -> Leadership:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Registration:
    """A published address on a lease kept alive; published again if the lease is lost."""

    def __init__(self, store: StateStore, role: str, index: int, address: str, ttl: int, lease_id: int | None,
                 on_lost: Callable[[str], None] | None = None):
        self.store = store
        self.role, self.index, self.address, self.ttl = role, index, address, ttl
        self.key = store.address_key(role, index)
        self.lease_id = lease_id
        self._keepalive = None
        self._revoked = False
        if lease_id is not None:
            self._keepalive = _KeepAlive(store, lease_id, ttl, self.key, on_lost or (lambda why: self._republish()))

    def _republish(self) -> None:
        logger.warning("the lease of %s expired; publishing %s again", self.key, self.address)
        try:
            lease = self.store._grant(self.ttl)
            self.store._put(self.key, self.address.encode(), lease)
        except Exception as e:  # noqa: BLE001 - retried at the next refresh
            logger.warning("could not publish %s again: %s", self.key, e)
            return
        old, self.lease_id = self.lease_id, lease
        self._keepalive.lease_id = lease
        logger.info("published %s again (lease %x replaces %x)", self.key, lease, old)

    def revoke(self) -> None:
        """Withdraw the address now."""
        if self._revoked:
            return
        self._revoked = True
        if self._keepalive is None:  # rides on the leader lease
            self.store._call(f"delete {self.key}", self.store._delete, self.key)
            return
        self._keepalive.stop()
        try:
            self.store._call(f"withdraw {self.key}", self.store._revoke, self._keepalive.lease_id)
        except StateStoreError as e:
            logger.warning("could not withdraw %s (%s); it expires within %ds", self.key, e, self.ttl)

    def _abandon(self) -> None:
        """Stop refreshing without withdrawing, as a crashed process would (tests)."""
        if self._keepalive is not None:
            self._keepalive.stop()
