"""Shard replicas of embedding tables in one process (docs/replicas.md): under an admission or
eviction policy the rows a lookup makes or removes on the primary reach the backup as numbered
entries, so the backup's tables equal the primary's bit for bit; an unbounded table's lookup
only makes rows at their initial values, which the pushes of those ids make on the backup too,
so it is not forwarded: the backup holds every row a push made, bit for bit, and lacks only
rows at their initial values. A new backup's snapshot carries the tables."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from elasticdl.model.embedding.policy import TablePolicy
from elasticdl.model.embedding.table import IndexedRows, TableInfo
from elasticdl.ps.replica_wire import decode_entry, encode_entry
from elasticdl.ps.replication import BackupApplier, Entry
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc.batch_position import BatchPosition
from tests.test_replication import adam, fingerprint, pair

DIM = 4
POLICIES = {
    "unbounded": TablePolicy(),
    "max-rows": TablePolicy(max_rows=40),
    "ttl": TablePolicy(ttl_versions=3),
    "admit-count": TablePolicy(admit_min_count=2, max_rows=60),
    "admit-chance": TablePolicy(admit_probability=0.5, ttl_versions=5),
}


def dense_model() -> dict[str, np.ndarray]:
    return {"dense/kernel": np.random.default_rng(0).normal(size=(DIM, 2)).astype(np.float32)}


def infos(policy: TablePolicy) -> list[TableInfo]:
    return [TableInfo("user", DIM, policy=policy),
            TableInfo("item", DIM, {"distribution": "normal", "mean": 0.0, "stddev": 0.1, "seed": 7}, policy)]


def tables_of(core: ParameterServer) -> dict:
    """Every bit of each table: rows, slots, each row's last update, in the table's own order
    (the eviction order when it evicts), its counters and admission sketch."""
    out = {}
    for name, table in core.shard.embeddings.items():
        ids, rows, slots, touched, meta = table.saved()
        out[name] = {
            "ids": ids.tobytes(), "rows": rows.tobytes(), "slots": {s: v.tobytes() for s, v in slots.items()},
            "touched": touched.tobytes(), "meta": {k: np.asarray(v).tobytes() for k, v in meta.items()},
            "counters": table.counters.as_list(), "live": len(table), "version": table.version,
            "policy": table.policy,
        }
    return out


def same_model(backup: ParameterServer, primary: ParameterServer) -> None:
    """An unbounded table's backup holds the rows its primary's pushes made, bit for bit (rows,
    slots, last update; by id: the order is where they were made, which nothing reads); a row
    the primary made by a lookup alone (never pushed) it lacks, and that row is what a training
    lookup of the id on the backup makes: its initial value, with fresh slots."""
    for name, table in primary.shard.embeddings.items():
        ids, rows, slots, touched, _ = table.saved()
        b_ids, b_rows, b_slots, b_touched, _ = backup.shard.embeddings[name].saved()
        where = {i: n for n, i in enumerate(ids.tolist())}
        assert set(b_ids.tolist()) <= set(where), f"{name}: the backup holds rows its primary does not"
        at = np.array([where[i] for i in b_ids.tolist()], np.int64)
        assert rows[at].tobytes() == b_rows.tobytes() and touched[at].tobytes() == b_touched.tobytes()
        assert all(slots[s][at].tobytes() == b_slots[s].tobytes() for s in slots)
        only = np.flatnonzero(~np.isin(ids, b_ids))
        if only.size:
            fresh = ParameterServer(PSSettings(use_async=True), adam())
            fresh.push_embedding_table_infos([table.info])
            made = fresh.lookup_embeddings(name, ids[only], create=True)
            _, _, fresh_slots, _, _ = fresh.shard.embeddings[name].saved()
            assert rows[only].tobytes() == made.tobytes(), f"{name}: a row only the primary holds was pushed"
            assert all(slots[s][only].tobytes() == fresh_slots[s].tobytes() for s in slots)
        counters, b_counters = table.counters, backup.shard.embeddings[name].counters
        assert counters.admissions == len(ids) and b_counters.admissions == len(b_ids)
    assert fingerprint(backup) == fingerprint(primary)


def train(primary: ParameterServer, rng, steps: int, first_task: int = 0, check=None) -> None:
    """Lookups of new and known ids then their pushes, as a worker does; every third lookup is not
    followed by a push (the worker died, or its push was refused): its rows exist all the same."""
    for step in range(steps):
        ids = np.unique(rng.integers(0, 120, size=12)).astype(np.int64)
        grads: dict = {"dense/kernel": rng.normal(size=(DIM, 2)).astype(np.float32)}
        for name in ("user", "item"):
            primary.lookup_embeddings(name, ids, create=True)
            grads[name] = IndexedRows(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))
        primary.lookup_embeddings("item", np.array([1000 + step], np.int64), create=False)  # evaluation: reads
        if step % 3 != 2:
            batch = BatchPosition(task_id=first_task + step, handout=1, records_end=8, records=8)
            primary.push_gradients(grads, primary.shard.version, None, batch=batch)
        if check is not None:
            check()


@pytest.mark.parametrize("settings", [{"use_async": True}, {"grads_to_wait": 2}], ids=["async", "sync-average-of-2"])
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_backup_tables_equal_the_primary_s_bit_for_bit_after_every_lookup_and_push(settings, policy):
    primary, backup, applier = pair(**settings)
    primary.push_model(dense_model())
    primary.push_embedding_table_infos(infos(policy))

    def same():
        if not policy.bounded:
            same_model(backup, primary)
            return
        assert tables_of(backup) == tables_of(primary)
        assert fingerprint(backup) == fingerprint(primary)

    train(primary, np.random.default_rng(5), 30, check=same)
    assert applier.applied == primary.replication.seq
    assert primary.shard.version >= 10 and sum(len(t) for t in primary.shard.embeddings.values()) > 20
    counters = primary.shard.embeddings["user"].counters
    if policy.evicts:
        assert counters.evictions_ttl + counters.evictions_max_rows > 0  # the case is exercised
    if policy.filters_admission:
        assert counters.dropped_gradients > 0


@pytest.mark.parametrize("policy", [TablePolicy(), TablePolicy(max_rows=40)], ids=["unbounded", "bounded"])
def test_a_lookup_that_changes_nothing_forwards_nothing(policy):
    """Known ids read again (the usual lookup once a table is warm) cost no forward, and neither
    does an unbounded table's lookup that makes rows (their initial values: a push makes them on
    the backup); a bounded table's lookup that makes rows is forwarded (it moves its eviction order)."""
    primary, _backup, _applier = pair(use_async=True)
    primary.push_model(dense_model())
    primary.push_embedding_table_infos(infos(policy))
    ids = np.arange(0, 20, dtype=np.int64)
    seq = primary.replication.seq
    primary.lookup_embeddings("user", ids, create=True)
    assert primary.replication.seq == seq + policy.bounded
    seq = primary.replication.seq
    primary.lookup_embeddings("user", ids, create=True)
    primary.lookup_embeddings("user", np.arange(100, 110, dtype=np.int64), create=False)  # unknown, not made
    assert primary.replication.seq == seq


def test_lookup_and_tables_entries_travel_over_the_wire_unchanged():
    policy = TablePolicy(admit_min_count=3, max_rows=10)
    for entry in (Entry(1, 4, "tables", (infos(policy),)),
                  Entry(1, 5, "lookup", ("user", np.array([3, 2**40 + 1, 7], np.int64), True))):
        decoded = decode_entry(*encode_entry(entry))
        assert (decoded.shard, decoded.seq, decoded.op) == (entry.shard, entry.seq, entry.op)
        if entry.op == "tables":
            assert decoded.args == entry.args
        else:
            name, ids, create = decoded.args
            assert (name, ids.dtype, ids.tolist(), create) == ("user", np.int64, [3, 2**40 + 1, 7], True)


@pytest.mark.parametrize("policy", [TablePolicy(), TablePolicy(max_rows=40, admit_min_count=2)],
                         ids=["unbounded", "bounded"])
def test_a_new_backup_s_snapshot_carries_the_tables_and_it_stays_equal_after(policy):
    from elasticdl.ps.replica_snapshot import begin_catch_up

    appliers: dict[int, BackupApplier] = {}
    primary, _backup, first = pair(lambda ps, entry: appliers[ps].receive(entry), use_async=True)
    appliers[1] = first
    primary.push_model(dense_model())
    primary.push_embedding_table_infos(infos(policy))
    rng = np.random.default_rng(9)
    train(primary, rng, 15)

    late = ParameterServer(PSSettings(use_async=True), adam())
    appliers[2] = BackupApplier(late, installed=False)
    seq, snapshot = begin_catch_up(primary, 2)
    pusher = threading.Thread(target=train, args=(primary, rng, 10, 100))  # goes on meanwhile
    pusher.start()
    appliers[2].install(seq, snapshot)
    pusher.join(timeout=60)
    assert not pusher.is_alive()
    if not policy.bounded:  # the snapshot held every row; lookups alone after it were not forwarded
        same_model(late, primary)
        train(primary, rng, 10, 200)
        same_model(late, primary)
        return
    assert tables_of(late) == tables_of(primary)  # a table that evicts keeps its rows in eviction order
    train(primary, rng, 10, 200)  # evictions and admissions after the catch-up happen alike
    assert tables_of(late) == tables_of(primary) and fingerprint(late) == fingerprint(primary)
