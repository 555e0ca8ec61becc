"""Where the master keeps what must outlive it: leader lock, task ledger, addresses.

Two stores with one contract:

- :class:`MemoryStateStore` (the default): process memory. Nothing survives the master,
  exactly as a job without etcd always ran.
- :class:`EtcdStateStore`: a real etcd v3 (``--etcd_endpoints``). A master killed and
  restarted finds its ledger there; a second master for the same job is refused (or waits).

and :class:`ResilientStore`, which the master writes its ledger through: it keeps serving
from memory while the store is unreachable, reports the outage once with how long it
lasted, and writes the newest snapshot when the store is back.

Key layout in etcd (``<job>`` is the job name)::

    /elasticdl/<job>/master                      leader lock: {"owner", "ttl", "since"}, on the leader's lease
    /elasticdl/<job>/addresses/<role>/<index>    "host:port", on the registrant's lease
                                                 (the master's own address rides on the leader lease)
    /elasticdl/<job>/ledger/head                 {"seq", "writer", "chunks", "count", "bytes", "crc32"}
    /elasticdl/<job>/ledger/seq                  the head's seq as 20 digits (a byte compare is a number compare)
    /elasticdl/<job>/ledger/chunks/<seq>-<writer>-<nonce>/<i>   the snapshot's compressed bytes, in order

Why one compact snapshot rather than one key per task: a change is a single transaction
that replaces the whole ledger, so a restarted master always reads a state the old one
actually had (never half an epoch), and writers may skip intermediate snapshots (only the
newest matters) -- which is what lets the master ride out an etcd outage in memory and
catch up with one write. Per-task keys fail exactly when it matters: a new epoch creates
all its tasks at once, and etcd refuses transactions of more than 128 operations
(``--max-txn-ops``) or 1.5 MiB (``--max-request-bytes``). A snapshot is compressed JSON, about
4 to 13 bytes per task: a ledger under ``chunk_bytes`` (1 MiB, some 100,000 tasks) goes in
the same transaction as its head; a larger one is written first as chunks under a fresh
directory, which the head transaction then makes current (and which a failed transaction
deletes). Readers read the head and its chunks at the head's revision. The price is
O(tasks) bytes per save; ``ResilientStore`` coalesces saves, so the write rate follows
etcd's speed, not the task rate.

Compare-and-set. ``save_ledger(snapshot, expected_revision)`` succeeds only if the head's
revision is still ``expected_revision`` (0: no ledger yet), the stored seq is below the
snapshot's, and, when this store holds the leader lock, the lock is still the one it took
(its create revision: a fencing token). Otherwise nothing is written and it raises
:class:`LedgerConflictError` (or :class:`LeadershipError`). A write whose reply was lost
(a timeout after etcd applied it) is recognised on retry by ``writer`` and ``crc32`` in
the head: the same snapshot counts as written, and a newer one goes on from there.

Outages. Every call retries transient failures with exponential backoff
(:class:`RetryPolicy`: 0.05 s doubling to 1 s, 5 s in all) and then raises
:class:`StoreUnavailableError`.
"""

from __future__ import annotations

import abc
import json
import logging
import math
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from elasticdl.master.ledger import LedgerSnapshot

logger = logging.getLogger(__name__)

ROOT = "/elasticdl"
DEFAULT_LEASE_TTL = 10.0
CHUNK_BYTES = 1 << 20  # etcd's default request limit is 1.5 MiB
_SEQ_DIGITS = 20


# ---------------------------------------------------------------- errors


class StateStoreError(RuntimeError):
    """Base class of the state store's errors."""


class LeadershipError(StateStoreError):
    """Another master holds the job's leader lock, or this master lost it."""


class LedgerConflictError(StateStoreError):
    """The stored ledger is not the one the write expected; nothing was written."""

    def __init__(self, message: str, current_revision: int = 0, stored_seq: int = -1):
        super().__init__(message)
        self.current_revision = current_revision
        self.stored_seq = stored_seq


class StoreUnavailableError(StateStoreError):
    """The store did not answer within the retry budget."""


# ---------------------------------------------------------------- retries


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``initial_delay`` growing by ``multiplier`` up to ``max_delay``,
    for at most ``budget`` seconds in all (0: one attempt)."""

    initial_delay: float = 0.05
    max_delay: float = 1.0
    multiplier: float = 2.0
    budget: float = 5.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_delay
        while True:
            yield delay
            delay = min(delay * self.multiplier, self.max_delay)


def _lease_seconds(ttl: float) -> int:
    """etcd leases count whole seconds."""
    if ttl <= 0:
        raise ValueError(f"a lease ttl must be positive. Received: ttl={ttl}")
    return max(1, math.ceil(ttl))


def _seq_bytes(seq: int) -> bytes:
    return f"{seq:0{_SEQ_DIGITS}d}".encode()


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything starting with ``prefix``."""
    b = bytearray(prefix)
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


@dataclass(eq=False)
class _CasFailed(Exception):
    """A ledger write's comparisons failed; what the store holds now."""

    revision: int  # of the head, 0 when absent
    seq: int  # stored seq, -1 when absent
    writer: str  # who wrote the head
    fenced_out: bool  # the leader lock is no longer the one this store took
    holder: str  # who holds the lock now ("" when nobody)
    crc32: int = -1  # of the stored snapshot's bytes


# ---------------------------------------------------------------- leases kept alive


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


# ---------------------------------------------------------------- the contract


class StateStore(abc.ABC):
    """Leader lock, task ledger and addresses of one job.

    Example::

        store = EtcdStateStore("127.0.0.1:2379", "my-job")   # or MemoryStateStore("my-job")
        leadership = store.acquire_leadership(owner="host:1234", ttl=10)
        snapshot, revision = store.load_ledger()              # (None, 0) for a new job
        revision = store.save_ledger(new_snapshot, revision)  # compare-and-set
        store.publish_address("master", 0, "10.0.0.5:50001")
        store.close()                                         # releases lock and addresses
    """

    def __init__(self, job_name: str, retry: RetryPolicy | None = None):
        if not job_name or "/" in job_name:
            raise ValueError(f"a job name must be non-empty and without '/'. Received: job_name={job_name!r}")
        self.job_name = job_name
        self.retry = retry or RetryPolicy()
        self.writer_id = uuid.uuid4().hex[:12]  # marks the ledger heads this store wrote
        self._lock = threading.Lock()
        self._leadership: Leadership | None = None
        self._fence: int | None = None
        self._registrations: list[Registration] = []
        # Seqs whose write failed in a way that may have landed anyway (a lost reply).
        self._maybe_written: set[int] = set()

    # ------------------------------------------------------------ keys

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.job_name}"

    @property
    def master_key(self) -> str:
        return f"{self.prefix}/master"

    def address_key(self, role: str, index: int) -> str:
        return f"{self._address_dir(role)}{int(index)}"

    def _address_dir(self, role: str) -> str:
        if not role or "/" in role:
            raise ValueError(f"a role must be non-empty and without '/'. Received: role={role!r}")
        return f"{self.prefix}/addresses/{role}/"

    @property
    def head_key(self) -> str:
        return f"{self.prefix}/ledger/head"

    @property
    def seq_key(self) -> str:
        return f"{self.prefix}/ledger/seq"

    @property
    def chunks_dir(self) -> str:
        return f"{self.prefix}/ledger/chunks/"

    # ------------------------------------------------------------ what the backends provide

    @abc.abstractmethod
    def describe(self) -> str:
        """For messages: ``"etcd at 127.0.0.1:2379"``."""

    @property
    @abc.abstractmethod
    def persistent(self) -> bool:
        """Whether the state outlives this process."""

    @abc.abstractmethod
    def _is_transient(self, error: Exception) -> bool: ...

    @abc.abstractmethod
    def _grant(self, ttl: int) -> int: ...

    @abc.abstractmethod
    def _refresh(self, lease_id: int) -> bool:
        """Refresh a lease; False when it no longer exists."""

    @abc.abstractmethod
    def _revoke(self, lease_id: int) -> None: ...

    @abc.abstractmethod
    def _try_lead(self, value: bytes, lease_id: int) -> tuple[int, str]:
        """Create the lock key on the lease unless it exists: (its create revision if it is
        on ``lease_id`` now, else 0; the holder's owner)."""

    @abc.abstractmethod
    def _put(self, key: str, value: bytes, lease_id: int | None) -> None: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _get_dir(self, prefix: str) -> dict[str, bytes]: ...

    @abc.abstractmethod
    def _delete_dir(self, prefix: str) -> None: ...

    @abc.abstractmethod
    def _write_ledger(self, data: bytes, seq: int, expected_revision: int, fence: int | None) -> int:
        """One compare-and-set attempt; the new revision, or raise _CasFailed."""

    @abc.abstractmethod
    def _read_ledger(self) -> tuple[bytes | None, int]: ...

    # ------------------------------------------------------------ retries

    def _call(self, what: str, fn: Callable, *args, retry: RetryPolicy | None = None):
        policy = retry or self.retry
        started = time.monotonic()
        attempts = 0
        for delay in policy.delays():
            attempts += 1
            try:
                return fn(*args)
            except Exception as e:
                if not self._is_transient(e):
                    raise
                elapsed = time.monotonic() - started
                if elapsed + delay > policy.budget:
                    raise StoreUnavailableError(
                        f"{self.describe()} is unreachable: could not {what} "
                        f"({attempts} attempts in {elapsed:.1f}s; last error: {e}). "
                        "Check that etcd is running and --etcd_endpoints."
                    ) from e
                time.sleep(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ leader lock

    def acquire_leadership(
        self,
        owner: str,
        ttl: float = DEFAULT_LEASE_TTL,
        wait: bool | float = False,
        on_lost: Callable[[str], None] | None = None,
    ) -> Leadership:
        """Take the job's leader lock; ``wait``: False (refuse at once), True (forever) or seconds.

        Raises :class:`LeadershipError` naming the other master when it holds the lock.
        """
        with self._lock:
            if self._leadership is not None and self._leadership.held:
                raise LeadershipError(f"this store already holds {self.master_key} for {self._leadership.owner}")
        seconds = _lease_seconds(ttl)
        value = json.dumps({"owner": owner, "ttl": seconds, "since": time.time()}).encode()
        deadline = None if wait is True else time.monotonic() + (0.0 if wait is False else float(wait))
        started = time.monotonic()
        lease = self._call("grant a lease", self._grant, seconds)
        told = False
        try:
            while True:
                revision, holder = self._call(f"take {self.master_key}", self._try_lead, value, lease)
                if revision:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    waited = time.monotonic() - started
                    raise LeadershipError(
                        f"another master (owner {holder}) holds {self.master_key}; stop it or wait for "
                        f"its lease to expire (up to its ttl after it stops)"
                        + (f"; still held after waiting {waited:.1f}s" if wait is not False else "")
                    )
                if not told:
                    logger.info("waiting for master %s to release %s", holder, self.master_key)
                    told = True
                # Keep our lease while waiting; it expires on its own if we die.
                if not self._call("refresh a lease", self._refresh, lease):
                    lease = self._call("grant a lease", self._grant, seconds)
                pause = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
                time.sleep(pause)
        except BaseException:
            try:
                self._revoke(lease)
            except Exception:  # noqa: BLE001 - it expires on its own
                pass
            raise
        leadership = Leadership(self, owner, seconds, lease, revision, on_lost)
        with self._lock:
            self._leadership = leadership
            self._fence = revision
        logger.info("%s holds the leader lock %s in %s (lease ttl %ds)", owner, self.master_key, self.describe(), seconds)
        return leadership

    @property
    def leadership(self) -> Leadership | None:
        return self._leadership

    def release(self) -> None:
        """Release the leader lock and withdraw the addresses this store published."""
        with self._lock:
            leadership, self._leadership = self._leadership, None
            registrations, self._registrations = self._registrations, []
        for registration in registrations:
            try:
                registration.revoke()
            except StateStoreError as e:
                logger.warning("could not withdraw %s: %s", registration.key, e)
        if leadership is not None:
            leadership.release()

    # ------------------------------------------------------------ ledger

    def save_ledger(self, snapshot: LedgerSnapshot, expected_revision: int, *,
                    retry: RetryPolicy | None = None) -> int:
        """Write ``snapshot`` if the ledger is still at ``expected_revision`` (0: none yet).

        Returns the new revision. Raises :class:`LedgerConflictError` when the ledger moved
        on or holds a seq >= ``snapshot.seq``, :class:`LeadershipError` when this store took
        the leader lock and no longer holds it, :class:`StoreUnavailableError` after the
        retry budget.
        """
        data = snapshot.to_bytes()
        crc = zlib.crc32(data)
        expected = expected_revision

        def attempt(expected: int) -> int:
            try:
                return self._write_ledger(data, snapshot.seq, expected, self._fence)
            except Exception as e:
                if self._is_transient(e):
                    self._maybe_written.add(snapshot.seq)
                raise

        while True:
            try:
                revision = self._call(f"write the ledger (seq {snapshot.seq})", attempt, expected, retry=retry)
                self._maybe_written.clear()
                return revision
            except _CasFailed as cas:
                if cas.fenced_out:
                    holder = f"now held by {cas.holder}" if cas.holder else "nobody holds it now"
                    raise LeadershipError(
                        f"this master no longer holds {self.master_key} ({holder}); "
                        "it must stop: its ledger would overwrite the new master's"
                    ) from None
                ours = cas.writer == self.writer_id and cas.seq in self._maybe_written
                if ours and cas.seq == snapshot.seq and cas.crc32 == crc:
                    self._maybe_written.clear()
                    return cas.revision  # this very write landed; its reply was lost
                if ours and cas.seq < snapshot.seq and cas.revision != expected:
                    self._maybe_written.discard(cas.seq)
                    expected = cas.revision  # an earlier write of ours landed after a lost reply
                    continue
                if cas.revision != expected:
                    raise LedgerConflictError(
                        f"the ledger changed since revision {expected} (now revision {cas.revision}, "
                        f"seq {cas.seq}, written by {cas.writer or 'nobody'}); another master wrote it",
                        cas.revision, cas.seq,
                    ) from None
                raise LedgerConflictError(
                    f"refused to write ledger seq {snapshot.seq}: the stored ledger is at seq {cas.seq} "
                    f"(revision {cas.revision}); an older snapshot never replaces a newer one",
                    cas.revision, cas.seq,
                ) from None

    def clear_ledger(self) -> None:
        """Delete the job's ledger (a finished job: a new run of the same name starts afresh)."""
        self._call("delete the ledger", self._delete_dir, f"{self.prefix}/ledger/")

    def load_ledger(self) -> tuple[LedgerSnapshot | None, int]:
        """The stored snapshot and its revision; ``(None, 0)`` when the job has none."""
        data, revision = self._call("read the ledger", self._read_ledger)
        if data is None:
            return None, 0
        return LedgerSnapshot.from_bytes(data), revision

    # ------------------------------------------------------------ addresses

    def publish_address(self, role: str, index: int, address: str, ttl: float = DEFAULT_LEASE_TTL) -> Registration:
        """Publish ``address`` under ``addresses/<role>/<index>`` on a lease kept alive.

        The master's address (role ``"master"``) rides on the leader lease when this store
        holds it, so it disappears with the leader.
        """
        key = self.address_key(role, index)
        seconds = _lease_seconds(ttl)
        leadership = self._leadership
        if role == "master" and leadership is not None and leadership.held:
            self._call(f"publish {key}", self._put, key, address.encode(), leadership.lease_id)
            registration = Registration(self, role, index, address, leadership.ttl, None)
        else:
            lease = self._call("grant a lease", self._grant, seconds)
            self._call(f"publish {key}", self._put, key, address.encode(), lease)
            registration = Registration(self, role, index, address, seconds, lease)
        with self._lock:
            self._registrations.append(registration)
        return registration

    def addresses(self, role: str) -> dict[int, str]:
        """Live addresses of ``role`` by index."""
        directory = self._address_dir(role)
        found = self._call(f"list {directory}", self._get_dir, directory)
        out = {}
        for key, value in found.items():
            suffix = key[len(directory):]
            if suffix.isdigit():
                out[int(suffix)] = value.decode()
        return dict(sorted(out.items()))

    def master_address(self) -> str | None:
        return self.addresses("master").get(0)

    # ------------------------------------------------------------ life

    def close(self) -> None:
        """Release everything this store holds."""
        self.release()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _head_json(seq: int, writer: str, chunks: str, count: int, data: bytes) -> bytes:
    return json.dumps({
        "seq": seq, "writer": writer, "chunks": chunks, "count": count,
        "bytes": len(data), "crc32": zlib.crc32(data),
    }).encode()


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


def _join_chunks(head: dict, chunks: list[bytes | None]) -> bytes:
    if any(c is None for c in chunks):
        raise StateStoreError(f"ledger seq {head['seq']} is missing chunks under {head['chunks']}")
    data = b"".join(chunks)
    if len(data) != head["bytes"] or zlib.crc32(data) != head["crc32"]:
        raise StateStoreError(f"ledger seq {head['seq']} under {head['chunks']} is corrupt (size or crc32)")
    return data


# ---------------------------------------------------------------- in memory


class _Unavailable(ConnectionError):
    pass


class MemoryBackend:
    """What :class:`MemoryStateStore` instances share: a small key-value store with leases
    and revisions, like etcd's. Each store gets its own unless given one (tests share one
    to play two masters). Set ``available = False`` to play an outage."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
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
        self.backend = backend or MemoryBackend()

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


def _owner(value: bytes) -> str:
    try:
        return repr(json.loads(value)["owner"])
    except (ValueError, KeyError, TypeError):
        return repr(value.decode(errors="replace"))


# ---------------------------------------------------------------- etcd


def _etcd_module():
    """etcd-sdk-python (module ``pyetcd``): python-etcd3's API on current protobuf."""
    try:
        import pyetcd

        return pyetcd
    except ImportError:
        pass
    try:  # the original python-etcd3, if that is what is installed (needs protobuf < 4)
        import etcd3

        return etcd3
    except ImportError:
        raise ImportError(
            "etcd support needs the etcd-sdk-python package: pip install etcd-sdk-python"
        ) from None


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"h1:2379,http://h2:2379"`` or a list of them -> [(host, port)]."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item.startswith("https://"):
            raise ValueError(f"TLS etcd endpoints are not supported yet. Received: {item}")
        hostport = item.removeprefix("http://").rstrip("/")
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, "2379"
        if not host or not port.isdigit():
            raise ValueError(f"an etcd endpoint is host:port (e.g. 127.0.0.1:2379). Received: {item!r}")
        parsed.append((host.strip("[]"), int(port)))
    if not parsed:
        raise ValueError(f"no etcd endpoint given. Received: {endpoints!r}")
    return parsed


class EtcdStateStore(StateStore):
    """The state of one job in etcd; see the module docstring for the key layout.

    ``rpc_timeout`` bounds each request; ``retry`` how long a call keeps trying; snapshots
    larger than ``chunk_bytes`` are written in chunks before the transaction that makes
    them current. Creating the store does not connect; the first call does.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        job_name: str,
        *,
        rpc_timeout: float = 2.0,
        retry: RetryPolicy | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        super().__init__(job_name, retry)
        self.endpoints = parse_endpoints(endpoints)
        self.chunk_bytes = chunk_bytes
        etcd = _etcd_module()
        self._etcd = etcd
        # Reconnect fast after an outage (gRPC's default backoff grows to 2 minutes), and never
        # shun an endpoint for long after a failure (the client's default is 300 s).
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        eps = [etcd.Endpoint(host, port, secure=False, time_retry=0.0, opts=options) for host, port in self.endpoints]
        self._client = etcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=rpc_timeout, failover=True)
        self._tx = self._client.transactions
        self._transient = (
            etcd.exceptions.ConnectionFailedError,
            etcd.exceptions.ConnectionTimeoutError,
            etcd.exceptions.InternalServerError,
            etcd.exceptions.NoServerAvailableError,
        )

    def describe(self) -> str:
        return "etcd at " + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    @property
    def persistent(self) -> bool:
        return True

    def _is_transient(self, error: Exception) -> bool:
        if isinstance(error, self._transient):
            return True
        code = getattr(error, "code", None)
        if callable(code):
            import grpc

            return code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return False

    def ping(self) -> None:
        """Raise :class:`StoreUnavailableError` (after the retry budget) unless etcd answers."""
        self._call("reach etcd", self._client.get, self.master_key)

    def _grant(self, ttl: int) -> int:
        return self._client.lease(ttl).id

    def _refresh(self, lease_id: int) -> bool:
        return any(r.TTL > 0 for r in self._client.refresh_lease(lease_id))

    def _revoke(self, lease_id: int) -> None:
        try:
            self._client.revoke_lease(lease_id)
        except Exception as e:
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            if "lease not found" not in details:  # already gone: revoked or expired
                raise

    def _try_lead(self, value: bytes, lease_id: int) -> tuple[int, str]:
        tx = self._tx
        ok, responses = self._client.transaction(
            compare=[tx.create(self.master_key) == 0],
            success=[tx.put(self.master_key, value, lease=lease_id), tx.get(self.master_key)],
            failure=[tx.get(self.master_key)],
        )
        found = responses[-1]
        if not found:  # the holder's lease expired between the compare and the read
            return 0, "(none)"
        current, meta = found[0]
        return (meta.create_revision if meta.lease_id == lease_id else 0), _owner(current)

    def _put(self, key: str, value: bytes, lease_id: int | None) -> None:
        self._client.put(key, value, lease=lease_id)

    def _delete(self, key: str) -> None:
        self._client.delete(key)

    def _get_dir(self, prefix: str) -> dict[str, bytes]:
        return {meta.key.decode(): value for value, meta in self._client.get_prefix(prefix)}

    def _delete_dir(self, prefix: str) -> None:
        self._client.delete_prefix(prefix)

    def _write_ledger(self, data: bytes, seq: int, expected_revision: int, fence: int | None) -> int:
        tx = self._tx
        # A directory per attempt: a failed attempt deletes its own chunks, never those of an
        # earlier attempt of the same seq that landed although its reply was lost.
        chunks_at = f"{self.chunks_dir}{seq:0{_SEQ_DIGITS}d}-{self.writer_id}-{uuid.uuid4().hex[:8]}/"
        parts = _split(data, self.chunk_bytes)
        staged = len(parts) > 1
        if staged:  # too big for one request: write the chunks first, invisible until the head names them
            for i, part in enumerate(parts):
                self._client.put(f"{chunks_at}{i:06d}", part)
        compare = [tx.mod(self.head_key) == expected_revision]
        if expected_revision:
            compare.append(tx.value(self.seq_key) < _seq_bytes(seq))
        if fence is not None:
            compare.append(tx.create(self.master_key) == fence)
        root, mine = self.chunks_dir.encode(), chunks_at.encode()
        success = [
            tx.put(self.head_key, _head_json(seq, self.writer_id, chunks_at, len(parts), data)),
            tx.put(self.seq_key, _seq_bytes(seq)),
            # every other ledger's chunks: older heads, and chunks a failed writer left behind
            tx.delete(root, range_end=mine),
            tx.delete(_prefix_end(mine), range_end=_prefix_end(root)),
        ]
        if not staged:
            success.append(tx.put(f"{chunks_at}{0:06d}", parts[0]))
        failure = [tx.get(self.head_key), tx.get(self.seq_key), tx.get(self.master_key)]
        if staged:
            failure.append(tx.delete(mine, range_end=_prefix_end(mine)))
        ok, responses = self._client.transaction(compare=compare, success=success, failure=failure)
        if ok:
            return responses[0].response_put.header.revision
        head, stored, lock = responses[0], responses[1], responses[2]
        info = json.loads(head[0][0]) if head else {}
        fenced_out = fence is not None and (not lock or lock[0][1].create_revision != fence)
        raise _CasFailed(
            head[0][1].mod_revision if head else 0,
            int(stored[0][0]) if stored else -1,
            info.get("writer", ""),
            fenced_out,
            _owner(lock[0][0]) if lock else "",
            info.get("crc32", -1),
        )

    def _read_ledger(self) -> tuple[bytes | None, int]:
        value, meta = self._client.get(self.head_key)
        if value is None:
            return None, 0
        info = json.loads(value)
        at = meta.response_header.revision  # chunks as they were when the head was read
        chunks = [self._client.get(f"{info['chunks']}{i:06d}", revision=at)[0] for i in range(info["count"])]
        return _join_chunks(info, chunks), meta.mod_revision

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._client.close()


# ---------------------------------------------------------------- riding out outages


@dataclass(frozen=True)
class Outage:
    """A time the store could not be written."""

    started: float  # wall-clock seconds
    seconds: float
    error: str  # the first failure
    snapshots_kept: int  # saves served from memory meanwhile (only the newest is written)


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
