"""The executor of a fallback to the cut with --ps_replicas (``ReplicaRecovery._fall_back``), the
backend, the PS commands and the client faked.

The simulator's seeds 185, 192 and 359 (``--mode replicas``, no checkpoint): PS A died, its shard
went to PS B, A came back as a spare; B died before A caught up, and the job fell back. A, told
to serve its own shard again, served it from its empty core, and the records it lacked were
counted nowhere. A spare that has not caught up is now lost with the dead PS (``lost``): without
a checkpoint it starts again empty as the dead PS does, and its shard's loss is counted."""

from __future__ import annotations

from types import SimpleNamespace

from elasticdl.master import controller as c
from elasticdl.master.recovery import Recovery
from elasticdl.master.replica_recovery import ReplicaRecovery
from tests.test_ps_loss_recovery import FakeBackend


class StandIn(Recovery, ReplicaRecovery):
    """The job's recovery and replica sides, with the PS commands recorded."""

    def __init__(self, checkpoint_dir: str = "", num_ps: int = 2):
        self.config = SimpleNamespace(
            checkpoints=SimpleNamespace(checkpoint_dir=checkpoint_dir),
            consistency=SimpleNamespace(get_model_steps=1, push_steps=1, overlap_communication=False),
            training=SimpleNamespace(minibatch_size=32),
        )
        self.backend = FakeBackend()
        self.commands: list[tuple[int, str]] = []
        self.routed: list = []
        self._ps = SimpleNamespace(num_ps=num_ps, reroute=self.routed.append)
        self.roles: list = []
        self.state = SimpleNamespace(term=3, record_shard_roles=lambda primary, backups: self.roles.append(primary))
        self.controller = SimpleNamespace(workers={0, 1})
        self._ps_args = [["--ps_id", str(i)] for i in range(num_ps)]
        self.ps_addresses = [f"127.0.0.1:{5000 + i}" for i in range(num_ps)]
        self._restarted: set[tuple[str, int]] = set()

    def _replica_command(self, ps: int, method: str, args: dict) -> dict:
        self.commands.append((ps, method))
        return {}


def fallback(dead: int, lost: tuple[int, ...]) -> c.PromoteBackup:
    return c.PromoteBackup(dead, (), ((), ()), (0, 1), 3, fallback=True, lost=lost)


def test_without_a_checkpoint_a_spare_not_caught_up_starts_again_empty_and_its_loss_is_counted():
    job = StandIn()
    answers = job._promote_backups(fallback(dead=1, lost=(0,)))
    assert answers == [c.PSRelaunched(0, None, missing=64)]  # 2 workers x 32 records since their last pull
    assert job.backend.calls == [("stop", "ps", 0), ("start", "ps", 0, ("--ps_id", "0", "--port", "5000"))]
    assert ("ps", 0) in job._restarted  # its exit, polled with the fallback's, is no death
    assert job.commands == []  # it is not told to serve its empty core as the shard
    assert [r.primary for r in job.routed] == [(0, 1)]


def test_with_a_checkpoint_a_spare_not_caught_up_goes_back_to_the_cut_with_the_survivors():
    job = StandIn(checkpoint_dir="/ckpt")
    assert job._promote_backups(fallback(dead=1, lost=(0,))) == []
    assert job.backend.calls == []  # the cut's relaunch rolls it back (or starts it again from the cut)
    assert job.commands == [(0, "configure")]  # it serves its own shard, to restore the cut there


def test_a_fallback_with_no_spare_restarts_nothing():
    job = StandIn()
    assert job._promote_backups(fallback(dead=1, lost=())) == []
    assert job.backend.calls == [] and job.commands == [(0, "configure")]
