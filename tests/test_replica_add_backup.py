"""The executor of a catch-up (``ReplicaRecovery._add_backup``) with the PS commands faked: a
relaunched PS's dead predecessor, still answering at its address, is never taken for the spare.

Found on the fake Kubernetes cluster (tests/test_k8s_replicas.py): a PS pod deleted with no grace
is gone from the API, and its exit reported, before its process is killed; the master's pooled
connection through the PS's service still reached that process, which took the catch-up. The
master counted the spare a backup it never was, the primary forwarded to a dead address, and
the job hung."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from elasticdl.master import controller as c
from tests.test_replica_fallback import StandIn


class Answering(StandIn):
    """Each PS answers ``routes`` with the table it holds."""

    def __init__(self, claims: dict[int, list[int]]):
        super().__init__()
        self.claims = claims
        self.controller = SimpleNamespace(workers={0}, replicas=SimpleNamespace(backups=[[], []]))

    def _replica_command(self, ps: int, method: str, args: dict) -> dict:
        super()._replica_command(ps, method, args)
        if method == "routes":
            return {"version": 0, "primary": self.claims[ps], "replica_address": f"127.0.0.1:{6000 + ps}"}
        return {}


ADD = c.AddBackup(ps=1, shards=(0, 1), primary=(0, 0), routes_version=1)  # shard 1 went to PS 0


def test_a_catch_up_is_not_sent_to_a_dead_spares_predecessor_that_still_answers():
    job = Answering({0: [0, 0], 1: [0, 1]})  # PS 1's old process: still shard 1's primary, it thinks
    [answer] = job._add_backup(ADD)
    assert isinstance(answer, c.BackupNotAdded) and "still claims shards [1]" in answer.reason
    assert [m for _, m in job.commands] == ["routes", "routes"]  # no configure, prepare nor catch-up


def test_the_relaunched_spare_which_claims_none_of_its_old_shards_catches_up():
    job = Answering({0: [0, 0], 1: [0, 0]})  # started with --moved_to {1: 0}
    assert job._add_backup(ADD) == [c.BackupAdded(1, (0, 1))]
    assert ("configure" in [m for _, m in job.commands]) and (0, "catch_up") in job.commands


class RefusingOnce(Answering):
    """Shard 1's primary refuses its first snapshot (a sync average in progress)."""

    def __init__(self):
        super().__init__({0: [0, 0], 1: [0, 0]})
        self.refused = False

    def _replica_command(self, ps: int, method: str, args: dict) -> dict:
        if method == "catch_up" and args["shard"] == 1 and not self.refused:
            self.refused = True
            self.commands.append((ps, method))
            raise Refused()
        return super()._replica_command(ps, method, args)


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self):
        return "1 gradients wait in the sync average: asked again later"


def test_a_catch_up_refused_after_a_shard_caught_up_keeps_that_shard_and_asks_for_the_rest():
    job = RefusingOnce()
    added, not_added = job._add_backup(ADD)
    assert added == c.BackupAdded(1, (0,), complete=False)
    assert isinstance(not_added, c.BackupNotAdded) and "sync average" in not_added.reason
    job.commands.clear()
    assert job._add_backup(c.AddBackup(ps=1, shards=(1,), primary=(0, 0), routes_version=1)) == [
        c.BackupAdded(1, (1,))]
    # Shard 0, caught up, is not prepared again (that dropped the backup its primary forwarded to).
    assert [(ps, m) for ps, m in job.commands if m in ("prepare", "catch_up")] == [(1, "prepare"), (0, "catch_up")]
