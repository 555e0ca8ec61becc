"""The wire of shard replicas (``--ps_replicas``, docs/replicas.md): the metadata that names a
call's shard, the routing table, and the PSReplica calls (raw bytes, JSON commands), no proto.

A call for shard i sent to another PS than i carries ``SHARD_HEADER: i``; without it a call is
for the PS's own shard, so with ``--ps_replicas 0`` nothing on the wire changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

SHARD_HEADER = "elasticdl-shard"  # the shard a call is for (absent: the PS's own)
ENTRY_HEADER = "elasticdl-replica-entry"  # a forwarded update's shard, number, kind and scalars (JSON)
SERVICE = "elasticdl.PSReplica"
METHODS = ("replicate", "configure", "promote", "set_backups", "routes", "prepare", "catch_up", "install")
# A PS that does not serve a shard as primary answers UNAVAILABLE with this in its details:
# the caller asks the PS for the routes again and retries (the one retry rule of worker/batch_loop.py).
MOVED = "moved"
CALL_SECONDS = 30.0
ROUTES_SECONDS = 5.0  # a PS that does not tell its routes by then is skipped (the others are asked)


@dataclass(frozen=True)
class Routes:
    """Shard i's primary runs on PS ``primary[i]``; ``version``: one more at each promotion (the
    newest table wins)."""

    version: int
    primary: tuple[int, ...]

    @classmethod
    def initial(cls, num_ps: int) -> Routes:
        return cls(0, tuple(range(num_ps)))

    def moved(self, shard: int, ps: int) -> Routes:
        primary = list(self.primary)
        primary[shard] = ps
        return Routes(self.version, tuple(primary))

    def to_dict(self) -> dict:
        return {"version": self.version, "primary": list(self.primary)}

    @classmethod
    def from_dict(cls, data: dict) -> Routes:
        return cls(int(data["version"]), tuple(int(p) for p in data["primary"]))


def backups_of(shard: int, num_ps: int, replicas: int) -> list[int]:
    """The PS holding shard ``shard``'s backups, in promotion order: the next ones on the ring."""
    return [(shard + k) % num_ps for k in range(1, replicas + 1)]


def call(channel: grpc.Channel, method: str, payload: bytes = b"", metadata=(), timeout: float = CALL_SECONDS) -> bytes:
    """One PSReplica call (bytes both ways)."""
    return channel.unary_unary(f"/{SERVICE}/{method}")(payload, metadata=tuple(metadata), timeout=timeout)


def command(channel: grpc.Channel, method: str, args: dict, metadata=(), timeout: float = CALL_SECONDS) -> dict:
    """A JSON command (configure, promote, set_backups, routes) and its JSON answer."""
    answer = call(channel, method, json.dumps(args).encode(), metadata, timeout)
    return json.loads(answer) if answer else {}


def newest_routes(channels: list[grpc.Channel]) -> Routes | None:
    """The routes as the reachable PS tell them (None: none answered). A PS knows which shards
    it serves as primary: each shard goes to the PS that claims it in the newest table (a PS
    relaunched after every replica of its shard was lost claims its own shard at version 0,
    and no PS of a newer table is left to contradict it); a shard no PS claims, to where the
    newest table says."""
    tables: dict[int, Routes] = {}
    for ps, channel in enumerate(channels):
        try:
            tables[ps] = Routes.from_dict(command(channel, "routes", {}, timeout=ROUTES_SECONDS))
        except grpc.RpcError:
            continue  # that PS is down (the one that died, maybe)
    return claimed_routes(tables)


def claimed_routes(tables: dict[int, Routes]) -> Routes | None:
    """``newest_routes`` from the tables PS told (PS -> its routes); also the simulator's rule."""
    if not tables:
        return None
    newest = max(tables.values(), key=lambda r: r.version)
    primary = []
    for shard, fallback in enumerate(newest.primary):
        claims = [(table.version, ps) for ps, table in tables.items() if table.primary[shard] == ps]
        primary.append(max(claims)[1] if claims else fallback)
    return Routes(newest.version, tuple(primary))


class ShardRoutes:
    """The routing side of ``PSClient`` (its channels and stubs are the client's): shard i's calls
    go to PS ``routes.primary[i]``, with ``SHARD_HEADER`` when that is not PS i."""

    routes: Routes | None = None  # None: no replicas, every shard on its own PS

    def reroute(self, routes: Routes) -> list[int]:
        """Send each shard's calls to its primary in ``routes`` (the master's, or what the PS
        claim: both are the truth when given); returns the shards that moved."""
        from elasticdl.rpc.auth import HeaderCallInterceptor
        from elasticdl.rpc.channel import ServiceStub

        held = self.routes or Routes.initial(self.num_ps)
        moved = [s for s, ps in enumerate(routes.primary) if ps != held.primary[s]]
        for shard in moved:
            channel = self._channels[routes.primary[shard]]
            if routes.primary[shard] != shard:
                channel = grpc.intercept_channel(channel, HeaderCallInterceptor(SHARD_HEADER, str(shard)))
            self._stubs[shard] = ServiceStub(channel, "PServer", raw_responses=self._raw_responses)
            self._pull_bytes[shard] = None
            self._bulk[shard] = False  # a moved shard's tensors go over gRPC (the raw-TCP port is per PS)
        self.routes = routes
        return moved

    def refresh_routes(self) -> list[int]:
        """Ask the PS for the newest routes (after a call found its PS unreachable or moved)."""
        if self.routes is None:
            return []
        newest = newest_routes(self._channels)
        return self.reroute(newest) if newest is not None else []
