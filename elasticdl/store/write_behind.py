"""Write-behind for the ledger: the master keeps serving while the store is unreachable.

:class:`ResilientStore` is what the master writes its ledger through. It keeps serving from
memory while the store is down, reports the outage once with how long it lasted
(:class:`Outage`), and writes the newest snapshot when the store is back. It works on any
:class:`~elasticdl.store.api.StateStore`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticdl.store.api import StateStore
from elasticdl.store.errors import (
    LeadershipError,
    LedgerConflictError,
    RetryPolicy,
    StateStoreError,
    StoreUnavailableError,
)
from elasticdl.store.ledger import LedgerSnapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outage:
    """A time the store could not be written."""

    started: float  # wall-clock seconds
    seconds: float
    error: str  # the first failure
    snapshots_kept: int  # saves served from memory meanwhile (only the newest is written)
    ongoing: bool = False  # not over yet: ``seconds`` so far


class ResilientStore:
    """The master's ledger writer: never blocks the job on the store for long.

    ``save`` hands the newest snapshot to a writer thread and, while the store answers,
    waits up to ``sync_timeout`` for it to be written (so a reported task is durable before
    the worker hears back). When the store is unreachable, ``save`` returns at once and the
    master goes on serving from memory; the writer retries with backoff and, when the store
    answers again, writes the newest snapshot (never an older one: a lower ``seq`` is
    dropped here, and the store's compare-and-set refuses it too), then logs the outage once
    with its length and calls ``on_outage``. Conflicts (another master) are fatal: they are
    logged, passed to ``on_fatal`` and raised by the next ``save``.

    Example::

        ledger = ResilientStore(store)
        snapshot = ledger.load_ledger()          # starts the writer
        ledger.save(snapshot.next(...))          # True: written; False: kept in memory for now
        ledger.close()                           # flushes what is pending
    """

    def __init__(
        self,
        store: StateStore,
        *,
        sync_timeout: float = 1.0,
        attempt: RetryPolicy | None = None,
        backoff: RetryPolicy | None = None,
        on_outage: Callable[[Outage], None] | None = None,
        on_fatal: Callable[[StateStoreError], None] | None = None,
    ):
        self.store = store
        self.sync_timeout = sync_timeout
        # One write attempt rides out a blip (0.5 s); then it is an outage, retried every 0.1 to 2 s.
        self._attempt = attempt or RetryPolicy(initial_delay=0.05, max_delay=0.2, budget=0.5)
        self._backoff = backoff or RetryPolicy(initial_delay=0.1, max_delay=2.0)
        self._on_outage = on_outage
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._revision: int | None = None
        self._pending: LedgerSnapshot | None = None
        self._persisted_seq = -1
        self._fatal: StateStoreError | None = None
        self._outage_started: float | None = None  # monotonic
        self._outage_wall = 0.0
        self._outage_error = ""
        self._kept = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self.outages: list[Outage] = []

    # ------------------------------------------------------------ the master's calls

    def load_ledger(self) -> LedgerSnapshot | None:
        """Read the stored ledger (None for a new job) and start writing; raises
        :class:`StoreUnavailableError` if the store cannot be read (nothing to serve yet)."""
        snapshot, revision = self.store.load_ledger()
        with self._cond:
            self._revision = revision
            self._persisted_seq = snapshot.seq if snapshot else -1
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop, name="ledger writer", daemon=True)
                self._thread.start()
        return snapshot

    def save(self, snapshot: LedgerSnapshot, wait: float | None = None) -> bool:
        """Keep ``snapshot`` as the newest and write it; True once it is in the store.

        Waits up to ``wait`` (default ``sync_timeout``) seconds, not at all during an
        outage. A snapshot not newer than one already given is ignored.
        """
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            if self._revision is None:
                raise RuntimeError("call load_ledger() before save(): the first write must know what is stored")
            if self._closed:
                raise RuntimeError("the ledger writer is closed")
            newest = self._pending.seq if self._pending is not None else self._persisted_seq
            if snapshot.seq <= newest:
                logger.debug("ledger seq %d ignored: seq %d is newer", snapshot.seq, newest)
                return snapshot.seq <= self._persisted_seq
            self._pending = snapshot
            if self._outage_started is not None:
                self._kept += 1
            self._cond.notify_all()
            timeout = self.sync_timeout if wait is None else wait
            if self._outage_started is not None or timeout <= 0:
                return False
            self._cond.wait_for(
                lambda: self._persisted_seq >= snapshot.seq or self._outage_started is not None
                or self._fatal is not None,
                timeout,
            )
            if self._fatal is not None:
                raise self._fatal
            return self._persisted_seq >= snapshot.seq

    def flush(self, timeout: float) -> bool:
        """Wait until the newest snapshot is written; False if it is not after ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None or self._fatal is not None, timeout)
            return self._pending is None and self._fatal is None

    @property
    def in_outage(self) -> bool:
        return self._outage_started is not None

    @property
    def outages_so_far(self) -> list[Outage]:
        """The outages that ended, and the current one with its length so far: a job that ends
        (or fails) during an outage reports it too."""
        with self._cond:
            current = [] if self._outage_started is None else [Outage(
                self._outage_wall, time.monotonic() - self._outage_started, self._outage_error, self._kept, True)]
            return [*self.outages, *current]

    @property
    def unreachable_for(self) -> float:
        """Seconds the current outage has lasted (0 when there is none)."""
        started = self._outage_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def persisted_seq(self) -> int:
        return self._persisted_seq

    @property
    def pending_seq(self) -> int | None:
        pending = self._pending
        return None if pending is None else pending.seq

    @property
    def revision(self) -> int | None:
        return self._revision

    def close(self, flush_timeout: float = 5.0) -> bool:
        """Write what is pending (up to ``flush_timeout``) and stop the writer."""
        flushed = self._fatal is None and (self._thread is None or self.flush(flush_timeout))
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
        if not flushed and self._pending is not None:
            logger.warning("ledger seq %d was not written to %s before closing", self._pending.seq,
                           self.store.describe())
        return flushed

    # ------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        delays = None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending is not None)
                if self._closed:
                    return
                snapshot, revision = self._pending, self._revision
            try:
                new_revision = self.store.save_ledger(snapshot, revision, retry=self._attempt)
            except StoreUnavailableError as e:
                self._enter_outage(e)
                delays = delays or self._backoff.delays()
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, next(delays))
                continue
            except (LedgerConflictError, LeadershipError) as e:
                logger.error("the ledger can no longer be written to %s: %s", self.store.describe(), e)
                with self._cond:
                    self._fatal = e
                    self._cond.notify_all()
                if self._on_fatal is not None:
                    self._on_fatal(e)
                return
            except Exception as e:  # noqa: BLE001 - the writer must not die silently
                logger.exception("unexpected error writing the ledger; retrying")
                self._enter_outage(e)
                delays = delays or self._backoff.delays()
                time.sleep(next(delays))
                continue
            delays = None
            outage = None
            with self._cond:
                self._revision = new_revision
                self._persisted_seq = max(self._persisted_seq, snapshot.seq)
                if self._outage_started is not None:
                    outage = Outage(self._outage_wall, time.monotonic() - self._outage_started,
                                    self._outage_error, self._kept)
                    self.outages.append(outage)
                    self._outage_started = None
            if outage is not None:  # reported before flush() returns
                logger.warning(
                    "%s is reachable again after an outage of %.1fs; wrote ledger seq %d "
                    "(%d changes were kept in memory meanwhile)",
                    self.store.describe(), outage.seconds, snapshot.seq, outage.snapshots_kept,
                )
                if self._on_outage is not None:
                    self._on_outage(outage)
            with self._cond:
                if self._pending is snapshot:
                    self._pending = None
                self._cond.notify_all()

    def _enter_outage(self, error: Exception) -> None:
        with self._cond:
            if self._outage_started is not None:
                return
            self._outage_started = time.monotonic()
            self._outage_wall = time.time()
            self._outage_error = str(error)
            self._kept = 0
            self._cond.notify_all()
        logger.warning(
            "%s is unreachable (%s); the master keeps serving from memory and writes the "
            "ledger when it is back", self.store.describe(), error,
        )
