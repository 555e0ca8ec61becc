"""The simulated master carrying out the replica decisions (``--ps_replicas``): it mirrors
elasticdl/master/replica_recovery.py against the simulated PS, whose ``ReplicaHost`` is the real
one. What to do is decided by the real controller (elasticdl/master/failover.py).

The oracle's side of a promotion: the promoted backup must hold every update its primary
acknowledged, and from then on the shard's ghost is what the primary held at the backup's
last update (sim/replicas.py checked, at each, that the backup held exactly that).
"""

from __future__ import annotations

from elasticdl.master import controller as c
from elasticdl.master.failover import ReplicaRoles
from elasticdl.ps.replica_snapshot import SnapshotRefused
from elasticdl.ps.server import StaleTermError
from elasticdl.rpc import replica_commands as wire
from elasticdl.sim.transport import Unavailable

# What a command to a PS that cannot carry it out raises here (gRPC errors in the real job).
COMMAND_ERRORS = (Unavailable, StaleTermError, SnapshotRefused, ConnectionError, KeyError)


class SimReplicaRecovery:
    """The replica side of ``SimMaster`` (its attributes are the master's)."""

    def _replica_roles(self) -> ReplicaRoles | None:
        mode = self.world.mode
        return ReplicaRoles.initial(mode.num_ps, mode.ps_replicas) if mode.ps_replicas else None

    def _refresh_routes(self) -> None:
        """PSClient._each: a call that found a PS away or moved asks every PS for the routes."""
        if not self.world.mode.ps_replicas:
            return
        tables = {ps.ps_id: ps.host.routes for ps in self.world.ps if ps is not None and ps.alive and not ps.frozen}
        routes = wire.claimed_routes(tables)
        if routes is not None:
            self.routes = list(routes.primary)

    def _ps(self, index: int):
        ps = self.world.ps[index]
        if ps is None or not ps.alive or ps.frozen:  # a frozen PS lets the command time out
            raise Unavailable(f"ps-{index} is not serving")
        return ps

    def _configure_replicas(self) -> None:
        """Job setup: every PS serves; each forwards its shard's updates to its backups."""
        if not self.world.mode.ps_replicas:
            return
        self.routes = list(range(self.world.mode.num_ps))
        for index in range(self.world.mode.num_ps):
            try:
                self._ps(index).configure(wire.Routes.initial(self.world.mode.num_ps))
            except Unavailable:
                pass  # it died already: its exit is handled as any PS death

    def _promote_backups(self, decision: c.PromoteBackup) -> list:
        world = self.world
        routes = wire.Routes(decision.routes_version, tuple(decision.primary))
        if decision.fallback:
            refilled = () if world.checkpoint_dir else decision.lost  # ReplicaRecovery._refill_lost
            for index in refilled:
                world.ps[index].alive = False  # a planned stop, not a death: no exit
                world.network.killed(f"ps-{index}")
                world.start_ps(index, restore_from="", fence=0)
            for index in range(world.mode.num_ps):
                if index != decision.dead and index not in refilled:
                    try:
                        self._ps(index).configure(routes, backups=False)
                    except Unavailable:
                        pass  # down too: its own exit relaunches it
            self.routes = list(decision.primary)
            return [c.PSRelaunched(index, None, missing=self._missing_without_cut()) for index in refilled]
        dead = world.ps[decision.dead]
        versions = []
        try:
            for shard, index in decision.promotions:
                ps = self._ps(index)
                applier = ps.host.appliers.get(shard)
                applied = applier.applied if applier is not None else -1
                versions.append(ps.host.promote(shard, self.term, routes))
                self._promoted(dead.host.cores[shard].replication, ps, shard, applied)
            for shard, backups in enumerate(decision.backups):
                primary = decision.primary[shard]
                if primary != decision.dead:
                    self._ps(primary).host.set_backups(shard, list(backups), self.term)
        except COMMAND_ERRORS as err:
            return [c.PromotionFailed(decision.dead, f"{type(err).__name__}: {err}")]
        if not decision.promotions:
            return []
        self.routes = list(decision.primary)
        return [c.BackupPromoted(decision.dead, decision.promotions, tuple(versions))]

    def _promoted(self, log, ps, shard: int, applied: int) -> None:
        """The oracle: what the promoted backup holds, against what its primary acknowledged."""
        world = self.world
        ledger = world.replica_ledger
        acked = ledger.acked.get(log, 0) if log is not None else 0
        if applied < acked:
            world.violation(f"shard {shard}'s backup on PS {ps.ps_id} was promoted at update {applied}, its "
                            f"primary had acknowledged update {acked}")
        if log is None:
            return  # its primary died before it was configured: it took no update
        snap = ledger.history.get(log, {}).get(applied)
        ghost = world.oracle.shards[shard]
        if snap is None:
            world.violation(f"shard {shard}'s backup on PS {ps.ps_id} was promoted at update {applied}, which "
                            f"its primary never made")
            return
        ghost.applied, ghost.pending, ghost.maybe_missing = snap.applied.copy(), list(snap.pending), snap.maybe_missing
        ledger.record(ps.host.cores[shard].replication, ps.host.cores[shard], ghost)

    def _add_backup(self, decision: c.AddBackup) -> list:
        routes = wire.Routes(decision.routes_version, tuple(decision.primary))
        done: list[int] = []
        try:
            for index in sorted({decision.ps, *(decision.primary[s] for s in decision.shards)}):
                self._ps(index).configure(routes)
            for shard in decision.shards:
                self._ps(decision.ps).host.prepare(shard)
                self._ps(decision.primary[shard]).host.catch_up(shard, decision.ps, self.term)
                done.append(shard)
        except COMMAND_ERRORS as err:
            not_added = c.BackupNotAdded(decision.ps, f"{type(err).__name__}: {err}")
            return [c.BackupAdded(decision.ps, tuple(done), complete=False), not_added] if done else [not_added]
        return [c.BackupAdded(decision.ps, decision.shards)]
