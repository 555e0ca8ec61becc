"""The state store's contract: what the master keeps that must outlive it.

A :class:`StateStore` holds one job's leader lock, task ledger (a
:class:`~elasticdl.store.ledger.LedgerSnapshot`) and the addresses of its processes. Every
backend implements the same few primitives (``_grant``, ``_refresh``, ``_try_lead``,
``_write_ledger``, ...) and inherits everything else from here, so the in-memory store
(:mod:`elasticdl.store.memory`, the default) and etcd (:mod:`elasticdl.store.etcd`) behave
alike: leadership with ``on_lost``, fencing, compare-and-set, leases on addresses.

Key layout (``<job>`` is the job name; the memory backend keeps the same keys)::

    /elasticdl/<job>/master                      leader lock: {"owner", "ttl", "since"}, on the leader's lease
    /elasticdl/<job>/addresses/<role>/<index>    "host:port", on the registrant's lease
                                                 (the master's own address rides on the leader lease)
    /elasticdl/<job>/ledger/head                 {"seq", "writer", "chunks", "count", "bytes", "crc32"}
    /elasticdl/<job>/ledger/seq                  the head's seq as 20 digits (a byte compare is a number compare)
    /elasticdl/<job>/ledger/chunks/<seq>-<writer>-<nonce>/<i>   the snapshot's compressed bytes, in order

Why one compact snapshot rather than one key per task: a change is a single transaction
that replaces the whole ledger, so a restarted master always reads a state the old one
actually had (never half an epoch), and writers may skip intermediate snapshots (only the
newest matters) -- which is what lets the master ride out an outage in memory
(:mod:`elasticdl.store.write_behind`) and catch up with one write. Per-task keys fail
exactly when it matters: a new epoch creates all its tasks at once, and etcd refuses
transactions of more than 128 operations (``--max-txn-ops``) or 1.5 MiB
(``--max-request-bytes``); :mod:`elasticdl.store.etcd` describes the chunking.

Compare-and-set. ``save_ledger(snapshot, expected_revision)`` succeeds only if the head's
revision is still ``expected_revision`` (0: no ledger yet), the stored seq is below the
snapshot's, and, when this store holds the leader lock, the lock is still the one it took
(its create revision: a fencing token). Otherwise nothing is written and it raises
:class:`LedgerConflictError` (or :class:`LeadershipError`). A write whose reply was lost
(a timeout after the store applied it) is recognised on retry by ``writer`` and ``crc32`` in
the head: the same snapshot counts as written, and a newer one goes on from there.

Outages. Every call retries transient failures (:class:`RetryPolicy`) and then raises
:class:`StoreUnavailableError` (:mod:`elasticdl.store.errors`).
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from elasticdl.store.errors import (
    LeadershipError,
    LedgerConflictError,
    RetryPolicy,
    StateStoreError,
    StoreUnavailableError,
)
from elasticdl.store.leadership import Leadership, Registration, _lease_seconds
from elasticdl.store.ledger import LedgerSnapshot

logger = logging.getLogger(__name__)

ROOT = "/elasticdl"
DEFAULT_LEASE_TTL = 10.0
CHUNK_BYTES = 1 << 20  # etcd's default request limit is 1.5 MiB
_SEQ_DIGITS = 20

# ---------------------------------------------------------------- the stored layout, shared by the backends


def _seq_bytes(seq: int) -> bytes:
    return f"{seq:0{_SEQ_DIGITS}d}".encode()


@dataclass(eq=False)
class _CasFailed(Exception):
    """A ledger write's comparisons failed; what the store holds now."""

    revision: int  # of the head, 0 when absent
    seq: int  # stored seq, -1 when absent
    writer: str  # who wrote the head
    fenced_out: bool  # the leader lock is no longer the one this store took
    holder: str  # who holds the lock now ("" when nobody)
    crc32: int = -1  # of the stored snapshot's bytes


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


def _owner(value: bytes) -> str:
    try:
        return repr(json.loads(value)["owner"])
    except (ValueError, KeyError, TypeError):
        return repr(value.decode(errors="replace"))


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

    def abandon(self) -> None:
        """Stop keeping the leases alive without a word to the store (it is unreachable, or the
        lock is lost): the lock and the addresses expire on their own."""
        with self._lock:
            leadership, self._leadership = self._leadership, None
            registrations, self._registrations = self._registrations, []
        for lease in [*registrations, *([leadership] if leadership is not None else [])]:
            lease._abandon()

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

    def publish_address(self, role: str, index: int, address: str, ttl: float = DEFAULT_LEASE_TTL,
                        on_lost: Callable[[str], None] | None = None) -> Registration:
        """Publish ``address`` under ``addresses/<role>/<index>`` on a lease kept alive.

        The master's address (role ``"master"``) rides on the leader lease when this store
        holds it, so it disappears with the leader. A lease that cannot be renewed in time is
        published again on a new one, or, with ``on_lost``, reported there instead (a PS ends
        itself: its master may have relaunched it elsewhere).
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
            registration = Registration(self, role, index, address, seconds, lease, on_lost)
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

    # ------------------------------------------------------------ shard replicas (docs/replicas.md)

    def put_shard_roles(self, shard: int, roles: dict[int, str], term: int) -> None:
        """--ps_replicas: shard ``shard``'s replicas (PS -> "primary" or "backup") as the master of
        leadership ``term`` set them, under ``shards/<shard>/replicas``."""
        key = f"{self.prefix}/shards/{int(shard)}/replicas"
        value = json.dumps({"term": term, "replicas": {str(ps): role for ps, role in sorted(roles.items())}})
        self._call(f"write {key}", self._put, key, value.encode(), None)

    def shard_roles(self) -> dict[int, dict]:
        """Each shard's stored roles: {shard: {"term": t, "replicas": {ps: role}}}."""
        directory = f"{self.prefix}/shards/"
        found = self._call(f"list {directory}", self._get_dir, directory)
        out = {}
        for key, value in found.items():
            shard, _, rest = key[len(directory):].partition("/")
            if shard.isdigit() and rest == "replicas":
                data = json.loads(value)
                out[int(shard)] = {"term": data["term"], "replicas": {int(p): r for p, r in data["replicas"].items()}}
        return dict(sorted(out.items()))

    # ------------------------------------------------------------ life

    def close(self) -> None:
        """Release everything this store holds."""
        self.release()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
