"""A PS process with ``--ps_replicas R``: its own shard's core and the backup cores of the R
shards before it, the calls routed to them by shard, and the PSReplica service (docs/replicas.md).

``ShardRouter`` stands where the PServer servicer stood: a call is served by the servicer of the
shard it names (``SHARD_HEADER``; none: this PS's own), only if this PS is that shard's primary;
else it is answered UNAVAILABLE "moved", and the caller asks for the routes again.
``ReplicaService`` takes forwarded updates (the backups' side) and the master's commands:
``configure`` (the peers' addresses and the routes, once every PS serves), ``promote`` (a backup
becomes its shard's primary, fenced by the master's term), ``set_backups`` and ``routes``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable

import grpc

from elasticdl.ps.replica_snapshot import SnapshotRefused, begin_catch_up
from elasticdl.ps.replica_wire import GrpcForwarder, decode_entry
from elasticdl.ps.replication import BackupApplier, PrimaryLog
from elasticdl.ps.server import ParameterServer, StaleTermError
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import replica_commands as wire
from elasticdl.rpc.trust import MASTER_CREDENTIAL_HEADER

logger = logging.getLogger(__name__)


class ReplicaHost:
    """The cores of one PS process and the roles it plays for each shard."""

    def __init__(self, own: ParameterServer, replicas: int, make_backup: Callable[[int], ParameterServer],
                 moved_to: dict[int, int] | None = None):
        """``make_backup(shard)``: a core for a shard this PS backs up (writing no checkpoint);
        ``moved_to``: a relaunched PS's shard -> its primary now (it serves its old shard no more)."""
        settings = own.settings
        self.ps_id, self.num_ps, self.replicas = settings.ps_id, settings.num_ps, replicas
        self.cores: dict[int, ParameterServer] = {self.ps_id: own}
        self.appliers: dict[int, BackupApplier] = {}
        self.checkpoint_dir = settings.checkpoint_dir  # a promoted core writes its shard's checkpoints here
        for k in range(1, replicas + 1):
            shard = (self.ps_id - k) % self.num_ps
            core = make_backup(shard)
            self.cores[shard] = core
            self.appliers[shard] = BackupApplier(core)
        self.routes = wire.Routes.initial(self.num_ps)
        for shard, ps in (moved_to or {}).items():
            self.routes = self.routes.moved(shard, ps)
        self.forwarder: GrpcForwarder | None = None
        self.replica_address = ""  # where this PS takes forwards (serve_replicas)
        self.servicers = {shard: PServerServicer(core) for shard, core in self.cores.items()}
        self._make_backup = make_backup
        self._lock = threading.Lock()

    @property
    def own(self) -> ParameterServer:
        return self.cores[self.ps_id]

    def primary_here(self, shard: int) -> bool:
        return self.routes.primary[shard] == self.ps_id and shard in self.cores

    # ------------------------------------------------------------ the master's commands

    def configure(self, addresses: list[str], token: str | None, credential: str, routes: wire.Routes,
                  backups: bool = True) -> None:
        """Every PS serves: forward this PS's primaries' updates to their backups from now on
        (``backups=False``: to none, after a fallback to the cut)."""
        with self._lock:
            if self.forwarder is None:
                self.forwarder = GrpcForwarder(addresses, token, credential)
            else:  # a relaunched peer takes forwards on a new port
                self.forwarder.set_addresses(addresses)
            self.routes = routes
            for shard in self.cores:
                core = self.cores[shard]
                if not self.primary_here(shard):
                    continue
                if core.replication is None:
                    ring = [p for p in wire.backups_of(shard, self.num_ps, self.replicas) if p != self.ps_id]
                    core.replication = PrimaryLog(shard, ring if backups else [], self.forwarder.forward)
                elif not backups:
                    core.replication.set_backups([])
        logger.info("replicas configured: shard %d's backups on PS %s", self.ps_id,
                    wire.backups_of(self.ps_id, self.num_ps, self.replicas))

    def promote(self, shard: int, term: int, routes: wire.Routes) -> int:
        """This PS's backup of ``shard`` becomes its primary (no backup of its own until a new one
        caught up). StaleTermError from a master of an older term. Returns the shard's version."""
        with self._lock:
            core = self.cores.get(shard)
            if core is None:
                raise KeyError(f"PS {self.ps_id} holds no replica of shard {shard}")
            core.check_term(term)  # a deposed master cannot promote
            applier = self.appliers.pop(shard, None)
            if applier is not None:
                applier.close()  # an update being applied finishes first; none waiting is applied after
            core.settings = dataclasses.replace(core.settings, checkpoint_dir=self.checkpoint_dir)
            core.replication = PrimaryLog(shard, [], self.forwarder.forward if self.forwarder else _unconfigured)
            self.routes = routes
        logger.warning("promoted to shard %d's primary at version %d (term %d): its primary's PS died",
                       shard, core.shard.version, term)
        return core.shard.version

    def set_backups(self, shard: int, backups: list[int], term: int) -> None:
        core = self.cores[shard]
        core.check_term(term)
        if core.replication is not None:
            core.replication.set_backups(backups)

    def prepare(self, shard: int) -> None:
        """Become a new backup of ``shard``: updates forwarded from now on wait for its snapshot."""
        with self._lock:
            if self.primary_here(shard):
                raise KeyError(f"PS {self.ps_id} is shard {shard}'s primary: it backs up other shards only")
            if shard not in self.cores:
                self.cores[shard] = self._make_backup(shard)
                self.servicers[shard] = PServerServicer(self.cores[shard])
            old = self.appliers.get(shard)
            if old is not None:
                old.close()  # an update of a former primary, waiting for its turn, is never applied now
            self.appliers[shard] = BackupApplier(self.cores[shard], installed=False)

    def catch_up(self, shard: int, backup: int, term: int) -> int:
        """This primary's side of a new backup on PS ``backup``: its snapshot sent, every later
        update forwarded to it. Returns the update number of the snapshot. SnapshotRefused:
        asked again later; ConnectionError: the backup did not take it (not added)."""
        core = self.cores[shard]
        core.check_term(term)
        if not self.primary_here(shard) or self.forwarder is None:
            raise KeyError(f"PS {self.ps_id} is not shard {shard}'s primary")
        seq, snapshot = begin_catch_up(core, backup)
        try:
            self.forwarder.install(backup, shard, seq, snapshot)
        except ConnectionError:
            core.replication.set_backups([b for b in core.replication.backups if b != backup])
            raise
        logger.info("shard %d: PS %d caught up at update %d (version %d) and is its backup again", shard, backup,
                    seq, core.shard.version)
        return seq

    def install(self, header: str, snapshot: bytes) -> None:
        fields = json.loads(header)
        applier = self.appliers.get(int(fields["shard"]))
        if applier is None:
            raise KeyError(f"PS {self.ps_id} was not prepared to back up shard {fields['shard']}")
        applier.install(int(fields["seq"]), snapshot)

    def replicate(self, header: str, payload: bytes) -> None:
        entry = decode_entry(header, payload)
        applier = self.appliers.get(entry.shard)
        if applier is None:
            raise KeyError(f"PS {self.ps_id} is no backup of shard {entry.shard}")
        applier.receive(entry)


def _unconfigured(_ps: int, _entry) -> None:
    raise ConnectionError("replicas not configured yet")


class ShardRouter:
    """The PServer service of a PS with replicas: each call to the servicer of its shard."""

    RAW_REQUESTS = PServerServicer.RAW_REQUESTS

    def __init__(self, host: ReplicaHost):
        self._host = host

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def route(request, context):
            return getattr(self._servicer(context), name)(request, context)

        return route

    @property
    def bulk_port(self) -> int:
        return self._host.servicers[self._host.ps_id].bulk_port

    def _servicer(self, context) -> PServerServicer:
        host = self._host
        sent = dict(context.invocation_metadata() or ()).get(wire.SHARD_HEADER)
        shard = host.ps_id if sent is None else int(sent) if str(sent).isdigit() else -1
        if not 0 <= shard < host.num_ps:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shard {sent!r}: one of 0..{host.num_ps - 1}")
        if not host.primary_here(shard):
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{wire.MOVED}: shard {shard}'s primary is PS {host.routes.primary[shard]} "
                          f"(routes version {host.routes.version}), not PS {host.ps_id}: ask for the routes again")
        return host.servicers[shard]


class ReplicaService:
    """The PSReplica calls (raw bytes, see elasticdl/rpc/replica_commands.py)."""

    def __init__(self, host: ReplicaHost, token: str | None, credential: str):
        self._host, self._token, self._credential = host, token, credential

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(wire.SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(getattr(self, name)) for name in wire.METHODS
        })

    def _check_master(self, context) -> None:
        """Forwards and commands carry the master's credential (a PS holds the job key too)."""
        verifier = self._host.own.verifier
        sent = dict(context.invocation_metadata() or ()).get(MASTER_CREDENTIAL_HEADER, "")
        problem = verifier.master_problem(str(sent)) if verifier is not None else ""
        if problem:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)

    def replicate(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        header = dict(context.invocation_metadata() or ()).get(wire.ENTRY_HEADER, "")
        try:
            self._host.replicate(header, payload)
        except ConnectionError as err:  # an update before it is missing: the primary sends it again
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except (KeyError, ValueError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return b""

    def configure(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        args = json.loads(payload)
        self._host.configure(list(args["addresses"]), self._token, self._credential,
                             wire.Routes.from_dict(args["routes"]), bool(args.get("backups", True)))
        return b"{}"

    def promote(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        args = json.loads(payload)
        try:
            version = self._host.promote(int(args["shard"]), int(args["term"]), wire.Routes.from_dict(args["routes"]))
        except StaleTermError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except KeyError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err.args[0]))
        return json.dumps({"version": version}).encode()

    def set_backups(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        args = json.loads(payload)
        try:
            self._host.set_backups(int(args["shard"]), [int(p) for p in args["backups"]], int(args["term"]))
        except StaleTermError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except KeyError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, f"PS {self._host.ps_id} holds no shard {err.args[0]}")
        return b"{}"

    def prepare(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        try:
            self._host.prepare(int(json.loads(payload)["shard"]))
        except KeyError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err.args[0]))
        return b"{}"

    def catch_up(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        args = json.loads(payload)
        try:
            seq = self._host.catch_up(int(args["shard"]), int(args["backup"]), int(args["term"]))
        except (StaleTermError, KeyError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except (SnapshotRefused, ConnectionError) as err:  # asked again later
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return json.dumps({"seq": seq}).encode()

    def install(self, payload: bytes, context) -> bytes:
        self._check_master(context)
        header = dict(context.invocation_metadata() or ()).get(wire.ENTRY_HEADER, "")
        try:
            self._host.install(header, payload)
        except KeyError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err.args[0]))
        return b""

    def routes(self, payload: bytes, context) -> bytes:
        """The routes this PS holds, and where it takes forwards (its replica server)."""
        return json.dumps({**self._host.routes.to_dict(), "replica_address": self._host.replica_address}).encode()


def backup_core(own: ParameterServer, shard: int, optimizer) -> ParameterServer:
    """A backup core of ``shard`` on this PS: it writes no checkpoint, and it loads the checkpoint
    its PS was started from (a resumed job's cut, --checkpoint_dir_for_init), so that it holds what
    the shard's primary holds (the simulator found backups left empty after a master restart: the
    first forwarded push failed on them, and the primary forwarded it again forever)."""
    core = ParameterServer(dataclasses.replace(own.settings, ps_id=shard, checkpoint_dir=""), optimizer,
                           verifier=own.verifier)
    core.restore()
    return core


def serve_replicas(server: grpc.Server, own: ParameterServer, replicas: int, make_optimizer: Callable[[], object],
                   token: str | None, credential: str, moved_to: dict[int, int]) -> tuple[PServerServicer, grpc.Server]:
    """Add the routed PServer service and the PSReplica service to ``server``, and serve the
    forwards on a server of their own; returns the own shard's servicer (the raw-TCP transport
    serves that shard only) and that replica server (started; the caller stops it)."""
    from elasticdl.ps.server import SERVER_THREADS
    from elasticdl.rpc.channel import POD_IP_ENV, add_service, bind_role, make_server

    def make_backup(shard: int) -> ParameterServer:
        return backup_core(own, shard, make_optimizer())

    host = ReplicaHost(own, replicas, make_backup, moved_to)
    add_service(server, "PServer", ShardRouter(host))
    service = ReplicaService(host, token, credential)
    server.add_generic_rpc_handlers((service.handler(),))
    # Forwards wait on the other PS, whose pushes wait on forwards to this one: served from the
    # same pool, many workers pushing to both could take every thread of each (all waiting).
    replica_server = make_server(max_workers=SERVER_THREADS, token=token)
    replica_server.add_generic_rpc_handlers((service.handler(),))
    host.replica_address = f"{os.environ.get(POD_IP_ENV, '') or '127.0.0.1'}:{bind_role(replica_server, 0)}"
    replica_server.start()
    logger.info("--ps_replicas %d: PS %d holds shard %d's primary and the backups of shards %s (forwards on %s)",
                replicas, host.ps_id, host.ps_id, sorted(host.appliers), host.replica_address)
    return host.servicers[host.ps_id], replica_server
