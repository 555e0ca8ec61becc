"""The master's commands to its parameter servers: checkpoints, rollbacks, fences, snapshots,
the learning rate, the live-worker count and stats. Each has a deadline: a PS that does not
answer is down or frozen, and the master must not freeze with it.

A part of ``PSClient`` (elasticdl/rpc/ps_client.py), in its own module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from elasticdl.proto import elasticdl_pb2

# The master's fence and restore calls wait at most this long for a PS: one that does not answer
# is down, and its own relaunch restores it.
COMMAND_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class PSStats:
    """One PS's update counters since it started."""

    version: int
    pushes_accepted: int
    pushes_rejected_stale: int
    pushes_rejected_invalid: int
    staleness: dict[int, int]  # staleness of applied gradients -> count
    grads_to_wait: int
    checkpoint_failures: int = 0  # checkpoint writes that failed (the next one tries again)
    checkpoint_error: str = ""  # the last failure's message
    records_applied: int = 0  # records whose gradients the shard applied (ps/data_position.py)
    term: int = 0  # the newest leadership term the PS heard of
    gradients_refused: int = 0  # by the PS's gradient guard (ps/gradient_guard.py), never applied
    # table -> {"rows", "bytes", "admissions", "dropped_gradients", "evictions_ttl", "evictions_max_rows"}
    embedding_tables: dict = field(default_factory=dict)


def stats_of(r) -> PSStats:
    """A ``get_stats`` answer as ``PSStats``."""
    return PSStats(
        version=r.version,
        pushes_accepted=r.pushes_accepted,
        pushes_rejected_stale=r.pushes_rejected_stale,
        pushes_rejected_invalid=r.pushes_rejected_invalid,
        staleness={c.staleness: c.count for c in r.staleness},
        grads_to_wait=r.grads_to_wait,
        checkpoint_failures=r.checkpoint_failures,
        checkpoint_error=r.checkpoint_error,
        records_applied=r.records_applied,
        term=r.term,
        gradients_refused=r.gradients_refused,
        embedding_tables={t.name: {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields if f.name != "name"}
                          for t in r.embedding_tables},
    )


class MasterCommands:
    """The master-only calls of ``PSClient`` (its stubs and term are the client's)."""

    def save_checkpoint(self, at_version: int = 0) -> list[str]:
        """Every PS saves its shard now, or (``at_version``) when it reaches that version: one cut.
        Paths ('' for a save armed for later)."""
        request = elasticdl_pb2.SaveCheckpointRequest(term=self.term, at_version=at_version)
        futures = [s.save_checkpoint.future(request) for s in self._stubs]
        return [f.result().path for f in futures]

    def restore(self, path: str, fence: int, only: list[int] | None = None) -> None:
        """``restore_each``, raising the first PS's error."""
        failed = self.restore_each(path, fence, only)
        if failed:
            raise failed[min(failed)]

    def restore_each(self, path: str, fence: int, only: list[int] | None = None) -> dict[int, grpc.RpcError]:
        """PS ``only`` (default: all), in parallel, go back to the checkpoint at ``path``; pushes of
        hand-outs below ``fence`` are refused from then on. Those that did not: their errors, by PS."""
        request = elasticdl_pb2.RestoreRequest(path=path, term=self.term, fence=fence)
        futures = {i: self._stubs[i].restore.future(request, timeout=COMMAND_TIMEOUT_SECONDS)
                   for i in (range(self.num_ps) if only is None else only)}
        failed = {}
        for ps, future in futures.items():
            try:
                future.result()
            except grpc.RpcError as err:
                failed[ps] = err
        return failed

    def fence(self, handouts: list[int], task_ids: list[int], done_below: int = 0) -> list[dict[int, int]]:
        """Every PS refuses pushes of ``handouts`` from now on; per PS, how far each task was taken.
        ``done_below``: a stream's tasks below it are done and folded in the ledger (their marks go)."""
        request = elasticdl_pb2.FenceRequest(handouts=handouts, task_ids=task_ids, term=self.term,
                                             done_below=done_below)
        futures = [s.fence.future(request, timeout=COMMAND_TIMEOUT_SECONDS) for s in self._stubs]
        return [{m.task_id: m.records_end for m in f.result().marks} for f in futures]

    def take_snapshot(self, snapshot_id: int) -> int:
        """Freeze the parameters on every PS; returns the (lowest) version frozen."""
        request = elasticdl_pb2.Snapshot(snapshot_id=snapshot_id)
        futures = [s.take_snapshot.future(request, timeout=COMMAND_TIMEOUT_SECONDS) for s in self._stubs]
        return min(f.result().version for f in futures)

    def drop_snapshot(self, snapshot_id: int) -> None:
        request = elasticdl_pb2.Snapshot(snapshot_id=snapshot_id)
        futures = [s.drop_snapshot.future(request, timeout=COMMAND_TIMEOUT_SECONDS) for s in self._stubs]
        for future in futures:
            future.result()

    def set_learning_rate(self, learning_rate: float | None) -> None:
        """Every PS's rate for pushes that bring none; None: back to the optimizer's own."""
        request = elasticdl_pb2.LearningRate(value=learning_rate, term=self.term)  # None: no value
        futures = [s.set_learning_rate.future(request, timeout=COMMAND_TIMEOUT_SECONDS) for s in self._stubs]
        for future in futures:
            future.result()

    def set_live_workers(self, count: int) -> None:
        request = elasticdl_pb2.LiveWorkers(count=count)
        futures = [s.set_live_workers.future(request, timeout=COMMAND_TIMEOUT_SECONDS) for s in self._stubs]
        for future in futures:
            future.result()

    def level_versions(self) -> int:
        """Sync, once training is over: every PS moves up to the highest shard's version
        (PS.level_version); returns it."""
        version = max(s.version for s in self.stats())
        request = elasticdl_pb2.LevelRequest(version=version, term=self.term)
        futures = [s.level_version.future(request, timeout=COMMAND_TIMEOUT_SECONDS) for s in self._stubs]
        return max(f.result().version for f in futures)

    def stats(self) -> list[PSStats]:
        """Every PS's stats (a PS that does not answer within the command deadline raises:
        a frozen PS must not freeze the master with it)."""
        return [stats_of(f.result()) for f in self.stats_futures(COMMAND_TIMEOUT_SECONDS)]

    def stats_futures(self, timeout: float) -> list[grpc.Future]:
        """One ``get_stats`` call per PS, in flight: the master probes its PS without waiting."""
        return [s.get_stats.future(elasticdl_pb2.Empty(), timeout=timeout) for s in self._stubs]
