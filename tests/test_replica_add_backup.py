"""The executor of a catch-up (``ReplicaRecovery._add_backup``) with the PS commands faked: a
relaunched PS's dead predecessor, still answering at its address, is never taken for the spare.

Found on the fake Kubernetes cluster (tests/test_k8s_replicas.py): a PS pod deleted with no grace
is gone from the API, and its exit reported, before its process is killed; the master's pooled
connection through the PS's service still reached that process, which took the catch-up. The
master counted the spare a backup it never was, the primary forwarded to a dead address, and
the job hung."""

from __future__ import annotations

from types import SimpleNamespace

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
