"""Shard replicas in one process: a primary core forwards each update it takes to a backup core,
which applies them in sequence order and ends up the same bit for bit (docs/replicas.md)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from elasticdl.model.non_trainable import NonTrainableChange
from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.replication import BackupApplier, Entry, PrimaryLog
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.push_outcome import PushOutcome


def adam():
    return make_optimizer(OptimizerSpec("Adam", {"learning_rate": 0.01}))


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "dense/kernel": rng.normal(size=(8, 4)).astype(np.float32),
        "dense/bias": rng.normal(size=(4,)).astype(np.float32),
        "bn/moving_mean": np.zeros(4, np.float32),
    }


def gradient(rng) -> dict:
    return {
        "dense/kernel": rng.normal(size=(8, 4)).astype(np.float32),
        "dense/bias": rng.normal(size=(4,)).astype(np.float32),
        "bn/moving_mean": NonTrainableChange(rng.normal(size=(4,)).astype(np.float32) * 0.01),
    }


def pair(forward=None, **settings):
    """(primary, backup): two cores of shard 0; the primary forwards straight to the backup."""
    primary = ParameterServer(PSSettings(**settings), adam())
    backup = ParameterServer(PSSettings(**settings), adam())
    applier = BackupApplier(backup)
    primary.replication = PrimaryLog(0, [1], forward or (lambda _ps, entry: applier.receive(entry)))
    return primary, backup, applier


def fingerprint(core: ParameterServer) -> dict:
    """Every bit of state a push or a command changes: parameters, slots, step, version, the
    data position, the sync average in progress, the gradient guard's running norm."""
    shard, strategy = core.shard, core.strategy
    sums = {n: _sum_bytes(v) for n, v in getattr(strategy, "_sums", {}).items()}
    return {
        "params": {n: v.tobytes() for n, v in shard.params.items()},
        "slots": {n: {s: v.tobytes() for s, v in slots.items()} for n, slots in shard.slots.items()},
        "step": shard.step, "version": shard.version, "marks": dict(core.position.marks),
        "records": core.position.records_applied, "pending": strategy.pending, "sums": sums,
        "grads_to_wait": strategy.grads_to_wait, "norm": core.guard.running_norm, "fenced": set(core.position.fenced),
    }


def _sum_bytes(value) -> bytes:
    """A sync average's running sum: an array, or an embedding table's rows (RowGradientSum)."""
    parts = getattr(value, "_parts", None)
    if parts is not None:
        return b"".join(p.ids.tobytes() + np.asarray(p.values).tobytes() for p in parts)
    return np.asarray(getattr(value, "values", value)).tobytes()


@pytest.mark.parametrize("settings", [
    {"use_async": True},
    {"grads_to_wait": 1},
    {"grads_to_wait": 3},
], ids=["async", "sync", "sync-average-of-3"])
def test_backup_equals_primary_bit_for_bit_after_every_push(settings):
    primary, backup, applier = pair(**settings)
    primary.push_model(model(), 0, ["bn/moving_mean"])
    rng = np.random.default_rng(1)
    for step in range(40):
        batch = BatchPosition(task_id=step // 4, handout=1, records_end=(step % 4 + 1) * 16, records=16)
        lr = None if step % 3 else 0.005
        primary.push_gradients(gradient(rng), primary.shard.version, lr, batch=batch, worker_id=0)
        if step == 20:
            primary.set_live_workers(2)  # sync: fewer gradients per version from now on
            primary.set_learning_rate(0.002)
        assert fingerprint(backup) == fingerprint(primary)  # after every push, also mid-average
    assert applier.applied == primary.replication.seq > 40
    assert primary.shard.version > 10


def test_refused_pushes_change_nothing_and_are_not_forwarded():
    primary, backup, applier = pair(grads_to_wait=1)
    primary.push_model(model(), 0, ["bn/moving_mean"])
    rng = np.random.default_rng(2)
    batch = BatchPosition(task_id=1, handout=1, records_end=16, records=16)
    assert primary.push_gradients(gradient(rng), 0, None, batch=batch).outcome is PushOutcome.APPLIED
    seq = primary.replication.seq
    again = primary.push_gradients(gradient(rng), 1, None, batch=batch)  # a retry: taken already
    stale = primary.push_gradients(gradient(rng), 0, None)  # sync: computed on an older version
    primary.fence([1], [1], 0)
    fenced = primary.push_gradients(gradient(rng), 1, None, batch=BatchPosition(1, 1, 32, 16))
    assert (again.reason, stale.outcome, fenced.outcome) == (
        "already applied", PushOutcome.REJECTED_STALE, PushOutcome.REJECTED_FENCED)
    assert primary.replication.seq == seq + 1  # only the fence
    assert fingerprint(backup) == fingerprint(primary)


def test_concurrent_pushes_reordered_on_the_wire_apply_in_order():
    """Pushes from several threads; each forward is delayed at random, so entries reach the
    backup out of order: it applies them by sequence number and matches the primary."""
    holder: list[BackupApplier] = []

    def late_forward(_ps, entry):
        threading.Event().wait(random.Random(entry.seq).uniform(0, 0.01))
        holder[0].receive(entry)

    primary, backup, applier = pair(late_forward, use_async=True)
    holder.append(applier)
    primary.push_model(model(), 0, ["bn/moving_mean"])

    def worker(worker_id):
        rng = np.random.default_rng(worker_id)
        for step in range(15):
            batch = BatchPosition(task_id=worker_id, handout=1, records_end=(step + 1) * 8, records=8)
            primary.push_gradients(gradient(rng), primary.shard.version, None, batch=batch, worker_id=worker_id)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert applier.applied == primary.replication.seq == 61
    assert fingerprint(backup) == fingerprint(primary)


def test_a_copy_is_applied_once_and_a_gap_is_waited_for():
    core = ParameterServer(PSSettings(use_async=True), adam())
    applier = BackupApplier(core, gap_wait=0.0)
    applier.receive(Entry(0, 1, "model", (model(), 0, ["bn/moving_mean"])))
    push = Entry(0, 2, "push", (gradient(np.random.default_rng(0)), 0, None, None, 0))
    later = Entry(0, 3, "live_workers", (1,))
    with pytest.raises(ConnectionError, match="update 3 arrived, 2 did not"):
        applier.receive(later)  # 2 is missing: the primary sends 3 again
    applier.receive(push)
    applier.receive(push)  # a resend of one applied
    applier.receive(later)
    assert (applier.applied, core.shard.version, core.shard.step) == (3, 1, 1)


def test_a_failed_forward_holds_the_push_until_the_backup_is_taken_off():
    """Strong consistency: the push is not answered while its backup is listed and unreachable."""
    attempts = threading.Semaphore(0)

    def unreachable(_ps, _entry):
        attempts.release()
        raise ConnectionError("PS 1 is down")

    primary, _backup, _applier = pair(unreachable, use_async=True, grads_to_wait=1)
    primary.replication.retry_seconds = 60.0  # only the master's word ends the wait
    answers = []
    pusher = threading.Thread(target=lambda: answers.append(primary.push_model(model(), 0, ["bn/moving_mean"])))
    pusher.start()
    assert attempts.acquire(timeout=10)
    assert answers == [] and pusher.is_alive()
    primary.replication.set_backups([])  # the master saw PS 1 exit
    pusher.join(timeout=10)
    assert answers == [(True, 0)]
    assert primary.replication.forwards_failed == 1


@pytest.mark.parametrize(("num_ps", "replicas", "problem"), [
    (1, 0, ""), (2, 1, ""), (3, 2, ""),
    (1, 1, "--ps_replicas 1 needs more parameter servers than replicas"),
    (2, 2, "give --num_ps 3 or more"),
])
def test_ps_replicas_is_checked_against_num_ps_at_submit(num_ps, replicas, problem):
    from elasticdl.config import ConfigError, JobConfig

    config = JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="d", num_ps=num_ps, ps_replicas=replicas)
    if not problem:
        config.validate(check_paths=False)
        return
    with pytest.raises(ConfigError, match=problem):
        config.validate(check_paths=False)


def test_ps_replicas_beyond_two_is_refused():
    from elasticdl.config import ConfigError, JobConfig

    with pytest.raises(ConfigError, match="ps_replicas"):
        JobConfig.from_flags(model_zoo="zoo", model_def="a.b.c", training_data="d", num_ps=4, ps_replicas=3).validate(check_paths=False)


def test_a_new_backup_catches_up_from_a_snapshot_while_pushes_go_on():
    """The primary's state at update s, then the updates after s (forwarded meanwhile, held by
    the new backup until its snapshot is in): it ends equal to the primary bit for bit."""
    from elasticdl.ps.replica_snapshot import begin_catch_up

    appliers: dict[int, BackupApplier] = {}
    primary, _backup, first = pair(lambda ps, entry: appliers[ps].receive(entry), grads_to_wait=1)
    appliers[1] = first
    primary.push_model(model(), 0, ["bn/moving_mean"])
    rng = np.random.default_rng(3)
    for step in range(10):
        primary.push_gradients(gradient(rng), primary.shard.version, None, batch=BatchPosition(1, 1, (step + 1) * 8, 8))
    primary.set_learning_rate(0.003)
    primary.fence([7], [], 0)

    late = ParameterServer(PSSettings(grads_to_wait=1), adam())
    appliers[2] = BackupApplier(late, installed=False)
    seq, snapshot = begin_catch_up(primary, 2)
    assert seq == primary.replication.seq and primary.replication.backups == [1, 2]
    # Pushes go on before the snapshot is installed: their forwards to PS 2 wait for it.
    pusher = threading.Thread(target=lambda: [
        primary.push_gradients(gradient(rng), primary.shard.version, None, batch=BatchPosition(2, 1, (i + 1) * 8, 8))
        for i in range(5)])
    pusher.start()
    appliers[2].install(seq, snapshot)
    pusher.join(timeout=30)
    assert not pusher.is_alive()
    assert fingerprint(late) == fingerprint(primary)
    assert late._learning_rate == 0.003 and appliers[2].applied == primary.replication.seq == seq + 5


def test_no_snapshot_while_a_sync_average_is_in_progress():
    from elasticdl.ps.replica_snapshot import SnapshotRefused, begin_catch_up

    primary, _backup, _applier = pair(grads_to_wait=2)
    primary.push_model(model(), 0, ["bn/moving_mean"])
    primary.push_gradients(gradient(np.random.default_rng(0)), 0, None)  # one of two: pending
    with pytest.raises(SnapshotRefused, match="1 gradients wait in the sync average"):
        begin_catch_up(primary, 2)
    assert primary.replication.backups == [1]


def test_an_update_waiting_for_its_turn_is_never_applied_once_the_backup_was_promoted():
    """The dead primary's update 3 arrived and waits for 2, which is still on the wire. Promoted
    meanwhile, the backup must apply neither: the worker's retry of that push at the new primary
    applies it, and it would be applied twice."""
    core = ParameterServer(PSSettings(use_async=True), adam())
    applier = BackupApplier(core)
    applier.receive(Entry(0, 1, "model", (model(), 0, ["bn/moving_mean"])))
    rng = np.random.default_rng(0)
    second = Entry(0, 2, "push", (gradient(rng), 0, None, BatchPosition(1, 1, 8, 8), 0))
    third = Entry(0, 3, "push", (gradient(rng), 0, None, BatchPosition(1, 1, 16, 8), 0))
    outcome = []

    def receive(entry):
        try:
            applier.receive(entry)
            outcome.append(f"{entry.seq} applied")
        except ConnectionError as err:
            outcome.append(str(err))

    thread = threading.Thread(target=receive, args=(third,))
    thread.start()
    deadline = time.monotonic() + 10
    while not applier._turn._waiters and time.monotonic() < deadline:  # until it waits for update 2
        threading.Event().wait(0.001)
    applier.close()  # the promotion
    receive(second)  # the dead primary's late forward
    thread.join(timeout=10)
    assert sorted(outcome) == ["shard 0: this PS is no longer its backup (promoted)"] * 2
    assert (core.shard.version, core.position.records_applied) == (0, 0)


def test_the_client_routes_each_shard_to_the_ps_that_claims_it_in_the_newest_table(monkeypatch):
    from elasticdl.rpc import replica_commands as wire

    told = {
        0: {"version": 1, "primary": [0, 0]},  # promoted: leads both
        1: {"version": 0, "primary": [0, 0]},  # the spare relaunched with its shard moved
    }
    monkeypatch.setattr(wire, "command", lambda channel, method, args, timeout: told[channel])
    assert wire.newest_routes([0, 1]) == wire.Routes(1, (0, 0))
    # Both died and came back from the cut: each claims its own shard again, at version 0.
    told[0] = {"version": 0, "primary": [0, 1]}
    told[1] = {"version": 0, "primary": [0, 1]}
    assert wire.newest_routes([0, 1]) == wire.Routes(0, (0, 1))
    # A deposed primary still up (cut off from the master) loses to the newer claim.
    told[0] = {"version": 1, "primary": [0, 0]}
    told[1] = {"version": 2, "primary": [1, 1]}
    assert wire.newest_routes([0, 1]) == wire.Routes(2, (1, 1))


def test_a_ps_with_replicas_takes_embedding_tables_for_its_own_shard():
    """Refused before lookups were replicated; now the router hands them to the shard's core."""
    from elasticdl.proto import elasticdl_pb2
    from elasticdl.ps.replica_host import ReplicaHost, ShardRouter

    class Context:
        def invocation_metadata(self):
            return ()

        def abort(self, code, details):
            raise AssertionError(code, details)

    own = ParameterServer(PSSettings(ps_id=0, num_ps=2), adam())
    router = ShardRouter(ReplicaHost(own, 1, lambda shard: ParameterServer(PSSettings(ps_id=shard, num_ps=2), adam())))
    from elasticdl.model.embedding.table import TableInfo

    info = TableInfo("t", 4)
    tables = elasticdl_pb2.EmbeddingTableInfos(tables=[
        elasticdl_pb2.EmbeddingTableInfo(name=info.name, dim=info.dim, initializer=info.to_json())])
    router.push_embedding_table_infos(tables, Context())
    assert [(info.name, info.dim) for info in own.embedding_tables()] == [("t", 4)]


def test_a_client_follows_the_claims_after_a_fallback_even_from_an_older_table():
    """After a failover (routes version 1: shard 1 on PS 0) both PS died and came back from the
    cut claiming their own shards at version 0. The client must follow them (it ignored the
    table as older and kept sending shard 1 to PS 0, which answered "moved" forever)."""
    import grpc

    from elasticdl.rpc import replica_commands as wire
    from elasticdl.rpc.ps_client import PSClient

    client = PSClient.__new__(PSClient)  # no server: only the routing state is exercised
    client._channels = [grpc.insecure_channel("127.0.0.1:1"), grpc.insecure_channel("127.0.0.1:2")]
    client._stubs, client._pull_bytes, client._bulk = [None, None], [None, None], [None, None]
    client._raw_responses, client.routes = frozenset(), wire.Routes.initial(2)
    assert client.reroute(wire.Routes(1, (0, 0))) == [1]
    assert client.reroute(wire.Routes(0, (0, 1))) == [1]
    assert client.routes.primary == (0, 1)
    for channel in client._channels:
        channel.close()


def test_an_evaluation_snapshot_is_the_primarys_alone_never_forwarded_and_gone_with_it():
    """docs/replicas.md, "Evaluation snapshots": a round's snapshot is taken on the primary, as
    without replicas. A snapshot on the backup would not spare the pushes their pause: a push is
    answered once its forward was applied, and the backup's copy would hold that apply back as
    long as the primary's copy holds the push now. The snapshot changes no replicated state (the
    backup stays equal, nothing numbered), and a backup promoted mid-round holds none: the
    round runs again once the PS is back (EvaluationRounds.ps_died)."""
    primary, backup, _ = pair(use_async=True)
    primary.push_model(model(), 0, ["bn/moving_mean"])
    rng = np.random.default_rng(7)
    for step in range(3):
        primary.push_gradients(gradient(rng), primary.shard.version, None,
                               batch=BatchPosition(task_id=1, handout=1, records_end=(step + 1) * 16, records=16))
    seq = primary.replication.seq
    version = primary.take_snapshot(1)
    assert primary.replication.seq == seq  # nothing numbered: nothing forwarded
    primary.push_gradients(gradient(rng), primary.shard.version, None,
                           batch=BatchPosition(task_id=1, handout=1, records_end=64, records=16))
    assert fingerprint(backup) == fingerprint(primary)
    assert primary.pull_snapshot(1)[1] == version == 3 < primary.shard.version  # frozen at the round's start
    with pytest.raises(KeyError, match="no snapshot 1"):
        backup.pull_snapshot(1)  # promoted, it would answer an evaluation worker this way
