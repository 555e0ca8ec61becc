"""The job carrying out the replica decisions (``--ps_replicas``, docs/replicas.md): the PS told
their peers once all serve, backups promoted under the master's term, the dead PS relaunched as
a spare that serves none of its old shards.

A part of the job's executor (``Job`` in elasticdl/master/job.py), in its own module; what to do
is decided by the controller (elasticdl/master/failover.py, pure).
"""

from __future__ import annotations

import json
import logging

import grpc

from elasticdl.master import controller as c
from elasticdl.master.failover import ReplicaRoles, StoredRoles, predecessor_claims
from elasticdl.rpc import replica_commands as wire
from elasticdl.rpc import trust
from elasticdl.rpc.channel import make_channel
from elasticdl.rpc.ps_commands import COMMAND_TIMEOUT_SECONDS
from elasticdl.store import StateStoreError

logger = logging.getLogger(__name__)


class ReplicaRecovery:
    """The replica side of ``Job`` (its attributes are the job's)."""

    def _replica_roles(self) -> ReplicaRoles | None:
        replicas = self.config.elasticity.ps_replicas
        return ReplicaRoles.initial(self.config.elasticity.num_ps, replicas) if replicas else None

    def _replica_command(self, ps: int, method: str, args: dict) -> dict:
        channel = make_channel(self.ps_addresses[ps], self._token)
        try:
            credential = trust.master_credential(self.backend.job_key())
            # As the master's other PS commands: a PS that does not answer in time is down (the
            # job's loop waits meanwhile), and its exit or the next Tick deals with it.
            return wire.command(channel, method, args, [(trust.MASTER_CREDENTIAL_HEADER, credential)],
                                timeout=COMMAND_TIMEOUT_SECONDS)
        finally:
            channel.close()

    def _replica_addresses(self) -> list[str]:
        """Where each PS takes forwards (a server of its own, on a port of its own)."""
        return [answer["replica_address"] for answer in self._routes_answers()]

    def _routes_answers(self) -> list[dict]:
        """Each PS's ``routes`` answer: the routes it holds, and where it takes forwards."""
        return [self._replica_command(ps, "routes", {}) for ps in range(len(self.ps_addresses))]

    def _configure_replicas(self) -> None:
        """Every PS serves: each learns its peers' addresses and starts forwarding to its backups."""
        if not self.config.elasticity.ps_replicas:
            return
        routes = wire.Routes.initial(len(self.ps_addresses)).to_dict()
        addresses = self._replica_addresses()
        for ps in range(len(self.ps_addresses)):
            self._replica_command(ps, "configure", {"addresses": addresses, "routes": routes})
        roles = self._replica_roles()  # the controller starts from the same table
        if self.state.resumed:
            self._read_back_roles(roles)
        self._record_roles(roles.primary, roles.backups)
        logger.info("--ps_replicas %d: each shard's updates are forwarded to its backups on the next %s",
                    self.config.elasticity.ps_replicas,
                    "PS" if self.config.elasticity.ps_replicas == 1 else f"{self.config.elasticity.ps_replicas} PS")

    def _promote_backups(self, decision: c.PromoteBackup) -> list:
        """Promote each backup (the PS checks the master's term), then tell every live primary its
        backups now, and route the master's own calls to the new primaries."""
        routes = {"version": decision.routes_version, "primary": list(decision.primary)}
        if decision.fallback:
            return self._fall_back(decision, routes)
        versions = []
        try:
            for shard, ps in decision.promotions:
                answer = self._replica_command(ps, "promote", {"shard": shard, "term": self.state.term,
                                                               "routes": routes})
                versions.append(int(answer["version"]))
            for shard, backups in enumerate(decision.backups):
                primary = decision.primary[shard]
                if primary != decision.dead:
                    self._replica_command(primary, "set_backups", {"shard": shard, "backups": list(backups),
                                                                   "term": self.state.term})
        except grpc.RpcError as err:
            return [c.PromotionFailed(decision.dead, f"{err.code().name}: {err.details()}")]
        self._record_roles(list(decision.primary), [list(b) for b in decision.backups])
        if not decision.promotions:
            return []  # a spare or a backup died: the backup lists were only updated
        self._ps.reroute(wire.Routes.from_dict(routes))
        for (shard, ps), version in zip(decision.promotions, versions):
            logger.warning("ps-%d died: shard %d goes on from its backup on PS %d at version %d, nothing rolled "
                           "back (--ps_replicas)", decision.dead, shard, ps, version)
        return [c.BackupPromoted(decision.dead, decision.promotions, tuple(versions))]

    def _fall_back(self, decision: c.PromoteBackup, routes: dict) -> list:
        """A shard lost every replica: every live PS serves its own shard again, forwarding to
        no backup, before the cut's relaunch rolls the job back (as without replicas). A PS lost
        with the dead one (a spare not caught up, ``decision.lost``) goes back to the cut as the
        survivors do; without a checkpoint it is started again empty, as the dead PS is, and its
        shard's records counted possibly missing: it never serves its empty core as the shard."""
        refilled = self._refill_lost(decision) if not self.config.checkpoints.checkpoint_dir else []
        for ps in range(len(self.ps_addresses)):
            if ps == decision.dead or any(r.index == ps for r in refilled):
                continue
            try:  # no forward is sent from now on: the addresses are not used
                self._replica_command(ps, "configure", {"addresses": self.ps_addresses, "routes": routes,
                                                        "backups": False})
            except grpc.RpcError as err:  # that PS is down too: its own exit relaunches it
                logger.warning("PS %d could not be told to forward to no backup: %s", ps, err.details())
        self._ps.reroute(wire.Routes.from_dict(routes))
        self._record_roles(list(decision.primary), [[] for _ in decision.primary])
        logger.error("ps-%d died and a shard it held has no live replica left: the job goes back to the "
                     "checkpoint cut, without backups from now on (--ps_replicas)", decision.dead)
        return refilled

    def _refill_lost(self, decision: c.PromoteBackup) -> list[c.PSRelaunched]:
        """No checkpoint: each PS lost with the dead one starts again empty (the workers give it
        their copy), as the dead PS does (the recovery policy's ``RefillEmpty``)."""
        missing = self._missing_without_cut()
        for ps in decision.lost:
            logger.error("ps-%d died and the job falls back, and PS %d (relaunched as a spare, not caught up) "
                         "holds no replica of its own shard %d: it starts again empty and the workers give it "
                         "their copy, so the updates of up to %d records since their last pull are missing from "
                         "that shard. Run the job with --checkpoint_dir to go back to a cut instead "
                         "(--ps_replicas keeps a shard only while a caught-up replica of it lives)",
                         decision.dead, ps, ps, missing)
            self.backend.stop("ps", ps)  # a planned stop: started again at once, its exit not a death
            self._start_ps(ps)
            self._restarted.add(("ps", ps))
        return [c.PSRelaunched(ps, None, missing=missing) for ps in decision.lost]

    def _add_backup(self, decision: c.AddBackup) -> list:
        """The spare learns its peers and the routes; each shard's primary sends it a snapshot and
        forwards every later update to it (a catch-up). Answered by ``BackupAdded``, or
        ``BackupNotAdded`` (asked again at the next Tick: the spare may not serve yet)."""
        routes = {"version": decision.routes_version, "primary": list(decision.primary)}
        done: list[int] = []
        try:
            answers = self._routes_answers()
            claimed = predecessor_claims(answers[decision.ps].get("primary", ()), decision)
            if claimed:
                return [c.BackupNotAdded(decision.ps, f"PS {decision.ps} still claims shards {claimed}: its dead "
                                         "predecessor answered, not the spare (asked again at the next Tick)")]
            addresses = [answer["replica_address"] for answer in answers]  # the spare's replica server: a new port
            for ps in sorted({decision.ps, *(decision.primary[s] for s in decision.shards)}):
                self._replica_command(ps, "configure", {"addresses": addresses, "routes": routes})
            for shard in decision.shards:
                self._replica_command(decision.ps, "prepare", {"shard": shard})
                self._replica_command(decision.primary[shard], "catch_up",
                                      {"shard": shard, "backup": decision.ps, "term": self.state.term})
                done.append(shard)
        except grpc.RpcError as err:
            not_added = c.BackupNotAdded(decision.ps, f"{err.code().name}: {err.details()}")
            if not done:
                return [not_added]
            # The shards caught up stay so (their primaries forward to the spare): only the rest is
            # asked again. Preparing a caught-up shard again dropped the backup its primary forwarded
            # to, whose pushes then held a sync average that refused the other shard's snapshot, at
            # every Tick: a livelock (test_e2e_replicas, under load).
            return self._backup_added(decision, tuple(done), complete=False) + [not_added]
        return self._backup_added(decision, decision.shards)

    def _backup_added(self, decision: c.AddBackup, shards: tuple[int, ...], complete: bool = True) -> list:
        table = self.controller.replicas
        self._record_roles(list(decision.primary), [
            [*table.backups[s], decision.ps] if s in shards else list(table.backups[s])
            for s in range(len(decision.primary))])
        logger.info("PS %d caught up and backs up shards %s again (--ps_replicas)%s", decision.ps, list(shards),
                    "" if complete else "; the others are asked again")
        return [c.BackupAdded(decision.ps, shards, complete)]

    def _read_back_roles(self, roles: ReplicaRoles) -> StoredRoles | None:
        """A resumed job: the roles its last master recorded say which shards had moved and which
        backups had not caught up. None of it carries over: every PS, backups included, was
        started again from the cut (or empty, without one) by this master, the processes that
        held those roles are gone, and each shard is led by its own PS again, as ``roles`` (the
        ring's) say, written back under this master's term. The leader lock fences the masters;
        a stored term above this one's is only reported (a lineage of another --checkpoint_dir
        counts its terms from another base)."""
        try:
            stored = StoredRoles.parse(self.state.stored_shard_roles(), len(self.ps_addresses))
        except (StateStoreError, ValueError) as err:
            logger.warning("could not read back the replica roles of the job's last master: %s", err)
            return None
        if stored is None:
            return None
        if stored.term > self.state.term:
            logger.warning("the replica roles in the state store are of leadership term %d, above this master's %d: "
                           "they are replaced with this master's", stored.term, self.state.term)
        short = [s for s, b in enumerate(stored.backups) if len(b) < self.config.elasticity.ps_replicas]
        if stored.moved() or short:
            logger.warning("the job's last master (term %d) had moved shards %s and left shards %s short of a "
                           "caught-up backup; every PS starts again from the cut, so each shard is led by its own PS "
                           "again, backed up by the next %d (--ps_replicas)", stored.term, stored.moved() or "{}",
                           short, self.config.elasticity.ps_replicas)
        return stored

    def _record_roles(self, primary: list[int], backups: list[list[int]]) -> None:
        """The roles in the state store (memory, or etcd): a failure to write them is logged and
        the job goes on (a resumed master only checks them, ``_read_back_roles``)."""
        try:
            self.state.record_shard_roles(primary, backups)
        except StateStoreError as err:
            logger.warning("could not record the shards' replica roles in the state store: %s", err)

    def _relaunch_spare(self, exit_, moved_to: tuple[tuple[int, int], ...]) -> list:
        """The dead PS comes back on its address serving none of the shards it led (their
        primaries moved): a worker that still asks it is told where they went."""
        logger.info("%s; relaunching it on port %s as a spare (its shards moved: %s)",
                    c.describe_exit(exit_, "died"), self._ps_port(exit_.index), dict(moved_to))
        self._start_ps(exit_.index, "--moved_to", json.dumps({str(s): p for s, p in moved_to}))
        return []

