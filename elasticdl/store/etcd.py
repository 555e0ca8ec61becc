"""The job's state in a real etcd v3 (``--etcd_endpoints``).

A master killed and restarted finds its ledger in :class:`EtcdStateStore`; a second master
for the same job is refused (or waits). The key layout and the compare-and-set rules are
the contract's (:mod:`elasticdl.store.api`).

Chunks. A snapshot is compressed JSON, about 4 to 13 bytes per task: a ledger under
``chunk_bytes`` (1 MiB, some 100,000 tasks) goes in the same transaction as its head; a
larger one is written first as chunks under a fresh directory, which the head transaction
then makes current (and which a failed transaction deletes). Readers read the head and its
chunks at the head's revision. The price is O(tasks) bytes per save;
:class:`~elasticdl.store.write_behind.ResilientStore` coalesces saves, so the write rate
follows etcd's speed, not the task rate.

The client is etcd-sdk-python (module ``pyetcd``), imported when a store is created, not
when this module is.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

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
from elasticdl.store.errors import RetryPolicy


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything starting with ``prefix``."""
    b = bytearray(prefix)
    for i in reversed(range(len(b))):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


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
    """The state of one job in etcd; the key layout is in :mod:`elasticdl.store.api`.

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
        """Raise :class:`~elasticdl.store.errors.StoreUnavailableError` (after the retry budget) unless etcd answers."""
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
