"""A resumed master reads back the replica roles its predecessor recorded (docs/replicas.md,
"Roles in the state store"), in either store: what had moved and which backups were short, and
why none of it carries over (every PS starts again from the cut), the roles then written back
under the new master's term."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from elasticdl.master.failover import ReplicaRoles, StoredRoles
from elasticdl.master.job_state import JobState
from tests.test_replica_fallback import StandIn

pytest_plugins = ["store_fixtures"]


def state_on(store, term: int, resumed: bool = False) -> JobState:
    state = JobState.__new__(JobState)  # only its store, term and resumed flag are used here
    state._store, state._leadership, state.lineage = store, SimpleNamespace(revision=term), None
    state.resumed = resumed
    return state


def first_master_after_a_failover(store, term: int) -> ReplicaRoles:
    """2 PS, --ps_replicas 1: PS 1 died, shard 1 went to PS 0, PS 1 not caught up yet."""
    roles = ReplicaRoles.initial(num_ps=2, replicas=1)
    state = state_on(store, term)
    state.record_shard_roles(roles.primary, roles.backups)
    roles.ps_lost(1, now=0.0)
    state.record_shard_roles(roles.primary, roles.backups)
    return roles


def test_the_stored_roles_read_back_as_each_shards_primary_backups_and_term(make_store):
    store = make_store()
    first_master_after_a_failover(store, term=7)
    stored = StoredRoles.parse(state_on(store, term=9).stored_shard_roles(), num_ps=2)
    assert stored == StoredRoles(term=7, primary=(0, 0), backups=((), ()))
    assert stored.moved() == {1: 0}
    assert StoredRoles.parse({}, num_ps=2) is None  # never run with --ps_replicas


@pytest.mark.parametrize("stored, problem", [
    ({0: {"term": 1, "replicas": {0: "primary"}}}, "the job has 2"),
    ({0: {"term": 1, "replicas": {0: "primary"}}, 1: {"term": 1, "replicas": {0: "backup"}}}, "no single primary"),
    ({0: {"term": 1, "replicas": {0: "primary"}}, 1: {"term": 1, "replicas": {5: "primary"}}}, "PS 0..1"),
])
def test_roles_that_do_not_fit_the_job_are_refused(stored, problem):
    with pytest.raises(ValueError, match=problem):
        StoredRoles.parse(stored, num_ps=2)


class Resumed(StandIn):
    def __init__(self, state):
        super().__init__()
        self.state = state
        self.config.elasticity = SimpleNamespace(ps_replicas=1, num_ps=2)

    def _replica_command(self, ps, method, args):
        super()._replica_command(ps, method, args)
        return {"replica_address": f"127.0.0.1:{6000 + ps}"} if method == "routes" else {}


def test_a_resumed_master_reads_the_roles_back_and_writes_the_rings_under_its_own_term(make_store, caplog):
    store = make_store()
    first_master_after_a_failover(store, term=7)
    job = Resumed(state_on(store, term=12, resumed=True))
    with caplog.at_level(logging.WARNING):
        job._configure_replicas()
    assert "had moved shards {1: 0}" in caplog.text and "starts again from the cut" in caplog.text
    assert store.shard_roles() == {0: {"term": 12, "replicas": {0: "primary", 1: "backup"}},
                                   1: {"term": 12, "replicas": {1: "primary", 0: "backup"}}}
    assert [m for _, m in job.commands].count("configure") == 2


def test_a_fresh_job_does_not_read_roles_back(make_store, caplog):
    store = make_store()
    first_master_after_a_failover(store, term=7)  # left by another run of the job's name
    job = Resumed(state_on(store, term=12, resumed=False))
    with caplog.at_level(logging.WARNING):
        job._configure_replicas()
    assert "moved shards" not in caplog.text
    assert store.shard_roles()[1] == {"term": 12, "replicas": {1: "primary", 0: "backup"}}


def test_roles_of_a_term_above_the_resumed_masters_are_reported_and_replaced(make_store, caplog):
    store = make_store()
    first_master_after_a_failover(store, term=20)  # e.g. a lineage of another --checkpoint_dir
    job = Resumed(state_on(store, term=12, resumed=True))
    with caplog.at_level(logging.WARNING):
        job._configure_replicas()
    assert "of leadership term 20, above this master's 12" in caplog.text
    assert {v["term"] for v in store.shard_roles().values()} == {12}
