"""Leases kept alive: the job's leader lock and the addresses that live with their process.

A :class:`Leadership` is the leader lock held on a lease; a :class:`Registration` is an
address published on a lease. Each has a thread (:class:`_KeepAlive`) refreshing the lease
every ttl/3. When the lease is gone anyway (the process was cut off from the store for
longer than the ttl while the store kept running), a leadership is *lost* (``on_lost``:
another master may lead now) and a registration publishes its address again.

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



class _KeepAlive:
    """Refreshes a lease every ttl/3 until stopped; says when the lease is gone."""

    def __init__(self, store: StateStore, lease_id: int, ttl: int, what: str, on_lost: Callable[[], None]):
        self._store = store
        self.lease_id = lease_id
        self._interval = max(ttl / 3.0, 0.05)
        self._what = what
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keepalive {what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        failing_since = None
        while not self._stop.wait(self._interval):
            try:
                alive = self._store._refresh(self.lease_id)
            except Exception as e:  # noqa: BLE001 - a keepalive thread must not die of an outage
                if failing_since is None:
                    failing_since = time.monotonic()
                    logger.warning("cannot refresh the lease of %s (%s); retrying every %.1fs",
                                   self._what, e, self._interval)
                continue
            if failing_since is not None:
                logger.info("lease of %s refreshed again after %.1fs", self._what, time.monotonic() - failing_since)
                failing_since = None
            if not alive:
                self._on_lost()
                if self._stop.is_set():
                    return


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
        self._keepalive = _KeepAlive(store, lease_id, ttl, f"the leader lock {self.key}", self._lease_lost)

    @property
    def held(self) -> bool:
        return not self._released and not self.lost.is_set()

    def _lease_lost(self) -> None:
        self._keepalive._stop.set()
        message = (f"lost the leader lock {self.key}: its lease expired while this master could "
                   f"not reach {self.store.describe()}; another master may have taken over")
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

    def __init__(self, store: StateStore, role: str, index: int, address: str, ttl: int, lease_id: int | None):
        self.store = store
        self.role, self.index, self.address, self.ttl = role, index, address, ttl
        self.key = store.address_key(role, index)
        self.lease_id = lease_id
        self._keepalive = None
        self._revoked = False
        if lease_id is not None:
            self._keepalive = _KeepAlive(store, lease_id, ttl, self.key, self._republish)

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
