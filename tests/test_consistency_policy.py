"""The worker's consistency policy, driven step by step: no processes, no parameter servers."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.proto import elasticdl_pb2
from elasticdl.rpc.ps_client import PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.consistency import ConsistencyPolicy, PushRejectedError

PARAMS = {"w": np.zeros(2, np.float32)}


def applied(version: int, with_params: bool = True) -> PushAnswer:
    return PushAnswer(PushOutcome.APPLIED, version, params=PARAMS if with_params else None)


def pending(version: int) -> PushAnswer:
    return PushAnswer(PushOutcome.ACCEPTED_PENDING, version)


def stale(version: int) -> PushAnswer:
    return PushAnswer(PushOutcome.REJECTED_STALE, version, "stale gradient: computed on version 1")


def pull(policy: ConsistencyPolicy, *versions: int, everything: bool = False):
    """Pull as the worker does; returns (the request made, the PS waited for in vain)."""
    request = policy.pull_request(everything)
    return request, policy.pulled(request, list(versions))


# ---------------------------------------------------------------- sync


def test_sync_pulls_before_every_batch_unless_every_push_answered_with_its_version():
    policy = ConsistencyPolicy(num_ps=2)
    assert policy.wants_push_parameters and policy.waits_for_version and not policy.applies_locally
    assert policy.must_pull()
    request, stalled = pull(policy, 3, 5)
    assert request.versions == (-1, -1) and request.wait_for_newer == (False, False) and stalled == []
    assert policy.versions == [3, 5] and policy.model_version == 5

    # Both PS answer with the version the push made: that stands in for the next pull.
    assert policy.push_answered({0: applied(4), 1: applied(6)}) == set()
    policy.batch_pushed()
    assert policy.versions == [4, 6] and not policy.must_pull()

    # One PS answers without parameters (its part is large): the next batch pulls.
    assert policy.push_answered({0: applied(5), 1: applied(7, with_params=False)}) == set()
    policy.batch_pushed()
    assert policy.versions == [5, 6] and policy.must_pull()
    request, _ = pull(policy, 5, 7)
    assert request.versions == (5, 6)


def test_strict_sync_waits_for_the_update_after_a_pending_push():
    policy = ConsistencyPolicy(num_ps=2)
    pull(policy, 0, 0)
    assert policy.push_answered({0: pending(0), 1: applied(1)}) == set()
    policy.batch_pushed()
    assert policy.must_pull()
    request, stalled = pull(policy, 1, 1)
    assert request.versions == (0, 1) and request.wait_for_newer == (True, False)
    assert stalled == [] and policy.versions == [1, 1]
    # The wait is for that one pull only.
    assert policy.pull_request().wait_for_newer == (False, False)


def test_a_pull_that_waited_in_vain_names_the_ps_that_did_not_move():
    policy = ConsistencyPolicy()
    pull(policy, 4)
    policy.push_answered({0: pending(4)})
    policy.batch_pushed()
    request, stalled = pull(policy, 4)  # the others never pushed within the timeout
    assert request.wait_for_newer == (True,) and stalled == [0]
    assert policy.pull_request().wait_for_newer == (False,)


def test_sync_with_a_tolerance_never_waits():
    policy = ConsistencyPolicy(sync_version_tolerance=1)
    assert not policy.waits_for_version
    pull(policy, 0)
    policy.push_answered({0: pending(0)})
    policy.batch_pushed()
    assert policy.must_pull() and policy.pull_request().wait_for_newer == (False,)


def test_a_push_answer_stands_in_only_within_a_task():
    policy = ConsistencyPolicy()
    pull(policy, 0)
    policy.push_answered({0: applied(1)})
    policy.batch_pushed()
    assert not policy.must_pull()
    policy.task_started()  # others may push many versions while this worker fetches a task
    assert policy.must_pull()
    assert policy.versions == [1]  # what it holds is still version 1: the pull sends that


# ---------------------------------------------------------------- stale and refused pushes


def test_a_stale_answer_means_pull_and_push_again_to_that_ps_only():
    policy = ConsistencyPolicy(num_ps=2)
    pull(policy, 3, 3)
    retry = policy.push_answered({0: applied(4), 1: stale(5)})
    assert retry == {1}
    assert policy.versions == [4, 3]  # the answer with parameters moved PS 0 only
    assert policy.must_pull()  # even though PS 0's answer carried its parameters
    request, _ = pull(policy, 4, 5)
    assert request.versions == (4, 3)
    assert policy.push_answered({1: applied(6)}) == set()
    # Only PS 1 answered this time: not every PS's latest parameters are held.
    assert policy.must_pull()
    policy.batch_pushed()
    assert policy.clock == 1


def test_a_stale_answer_keeps_the_wait_of_an_earlier_pending_push():
    policy = ConsistencyPolicy(num_ps=2)
    pull(policy, 0, 0)
    policy.push_answered({0: pending(0), 1: stale(1)})
    assert policy.pull_request().wait_for_newer == (True, False)


@pytest.mark.parametrize("outcome", [PushOutcome.REJECTED_INVALID, PushOutcome.PUSH_OUTCOME_UNSPECIFIED])
def test_a_refusal_that_is_not_staleness_raises(outcome):
    policy = ConsistencyPolicy(num_ps=2)
    pull(policy, 0, 0)
    refused = PushAnswer(outcome, 0, "gradient for 'w' contains NaN or Inf")
    with pytest.raises(PushRejectedError, match=rf"PS 1 rejected the gradients \({outcome.name}\): .*NaN"):
        policy.push_answered({0: pending(0), 1: refused})
    # PS 0 took its part: the next pull still waits for that update.
    assert policy.pull_request().wait_for_newer == (True, False)
    assert policy.clock == 0 and policy.versions == [0, 0]


def test_the_reason_text_decides_nothing():
    policy = ConsistencyPolicy()
    pull(policy, 0)
    # "stale" in the text of an invalid push does not make it retryable...
    with pytest.raises(PushRejectedError):
        policy.push_answered({0: PushAnswer(PushOutcome.REJECTED_INVALID, 0, "stale")})
    # ...and a stale push needs no text to be.
    assert policy.push_answered({0: PushAnswer(PushOutcome.REJECTED_STALE, 2, "")}) == {0}


# ---------------------------------------------------------------- async and SSP


def test_async_pulls_every_get_model_steps_batches_and_applies_locally_between():
    policy = ConsistencyPolicy(use_async=True, get_model_steps=3)
    assert not policy.wants_push_parameters and not policy.waits_for_version and policy.applies_locally
    pull(policy, 0)
    pulls = []
    for batch in range(7):
        if policy.must_pull():
            pulls.append(batch)
            pull(policy, batch)
        assert policy.push_answered({0: applied(batch + 1, with_params=False)}) == set()
        policy.batch_pushed()
    assert pulls == [3, 6]
    assert policy.versions == [6]  # answers without parameters leave the held version alone
    assert policy.clock == 7


def test_async_with_one_step_pulls_before_every_batch_but_the_first():
    policy = ConsistencyPolicy(use_async=True)
    assert not policy.applies_locally
    assert not policy.must_pull()  # a fresh worker pulls while it initializes the PS
    policy.batch_pushed()
    assert policy.must_pull()


def test_ssp_waits_only_while_more_than_the_bound_ahead_of_the_slowest():
    policy = ConsistencyPolicy(use_async=True, staleness_bound=2)
    assert policy.bounded
    assert not policy.must_wait(5, 3)
    assert policy.must_wait(6, 3)
    assert not policy.must_wait(3, 3)
    for _ in range(4):
        policy.batch_pushed()
    assert policy.clock == 4
    unbounded = ConsistencyPolicy(use_async=True)
    assert not unbounded.bounded and not unbounded.must_wait(100, 0)
    assert not ConsistencyPolicy(staleness_bound=2).bounded  # only with --use_async


# ---------------------------------------------------------------- snapshots, reconnects, init


@pytest.mark.parametrize("use_async", [False, True])
def test_after_an_evaluation_snapshot_the_next_training_batch_pulls_everything(use_async):
    policy = ConsistencyPolicy(use_async=use_async, get_model_steps=4 if use_async else 1, num_ps=2)
    pull(policy, 7, 8)
    if not use_async:
        policy.push_answered({0: applied(8), 1: applied(9)})
    policy.batch_pushed()
    assert not policy.must_pull()
    policy.snapshot_loaded()
    assert policy.must_pull()
    assert policy.versions == [-1, -1]
    request, _ = pull(policy, 9, 9)
    assert request.versions == (-1, -1)
    assert policy.must_pull() is not use_async  # sync pulls before every batch anyway


def test_a_snapshot_keeps_the_wait_for_a_pending_push():
    policy = ConsistencyPolicy()
    pull(policy, 0)
    policy.push_answered({0: pending(0)})
    policy.snapshot_loaded()
    assert policy.pull_request() == policy.pull_request(everything=True)
    assert policy.pull_request().wait_for_newer == (True,)


def test_after_a_ps_reconnect_everything_is_pulled_and_nothing_waited_for():
    policy = ConsistencyPolicy(num_ps=2)
    pull(policy, 10, 10)
    policy.push_answered({0: pending(10), 1: stale(11)})
    policy.ps_reconnected()  # PS 1 may be back from an older checkpoint, or empty
    assert policy.must_pull()
    request, stalled = pull(policy, 10, 4)
    assert request.versions == (-1, -1) and request.wait_for_newer == (False, False)
    assert stalled == [] and policy.versions == [10, 4]


def test_a_ps_reconnect_forgets_a_fresh_answer():
    policy = ConsistencyPolicy()
    pull(policy, 0)
    policy.push_answered({0: applied(1)})
    policy.batch_pushed()
    policy.ps_reconnected()
    assert policy.must_pull() and policy.versions == [-1]


def test_pulling_everything_leaves_what_is_held_until_the_answer():
    policy = ConsistencyPolicy(num_ps=2)
    pull(policy, 2, 3)
    request = policy.pull_request(everything=True)
    assert request.versions == (-1, -1) and policy.versions == [2, 3]
    assert policy.pulled(request, [2, 3]) == [] and policy.versions == [2, 3]


def test_from_config_and_bad_arguments():
    from elasticdl.config import JobConfig

    config = JobConfig.from_flags(model_zoo="z", model_def="a.b.c", training_data="x", use_async=True, staleness_bound=3,
                       get_model_steps=2)
    policy = ConsistencyPolicy.from_config(config, num_ps=3)
    assert (policy.use_async, policy.staleness_bound, policy.get_model_steps, policy.num_ps) == (True, 3, 2, 3)
    assert policy.versions == [-1, -1, -1]
    with pytest.raises(ValueError, match="num_ps must be at least 1. Received: num_ps=0"):
        ConsistencyPolicy(num_ps=0)
    with pytest.raises(ValueError, match="get_model_steps"):
        ConsistencyPolicy(use_async=True, get_model_steps=0)


# ---------------------------------------------------------------- the protocol's enum


def test_the_python_enum_names_every_member_of_the_protocols():
    assert [o.name for o in PushOutcome] == [v.name for v in elasticdl_pb2.PushOutcome.DESCRIPTOR.values]
    assert [o for o in PushOutcome if o.accepted] == [PushOutcome.APPLIED, PushOutcome.ACCEPTED_PENDING]
    assert [o for o in PushOutcome if o.applied] == [PushOutcome.APPLIED]


RECONNECT_MODES = {
    "sync": dict(),
    "sync-tolerance": dict(sync_version_tolerance=2),
    "async": dict(use_async=True),
    "async-get-model-steps": dict(use_async=True, get_model_steps=4),
    "ssp": dict(use_async=True, staleness_bound=2),
    "push-steps": dict(use_async=True, push_steps=3),
    "overlap": dict(use_async=True, overlap=True),
}


@pytest.mark.parametrize("mode", sorted(RECONNECT_MODES))
@pytest.mark.parametrize("event", ["ps_reconnected", "snapshot_loaded"])
def test_after_a_reconnect_every_mode_pulls_before_it_computes_or_pushes(mode, event):
    # Issue 25: async kept must_pull() False after a reconnect, and pushed version -1.
    policy = ConsistencyPolicy(num_ps=2, **RECONNECT_MODES[mode])
    pull(policy, 3, 3)
    if policy.accumulates:
        policy.batch_accumulated()  # gradients kept to push: a pull would not come before the push
    elif policy.overlap:
        policy.exchange_started()  # an exchange in flight: the batch would compute on what is held
    assert not policy.must_pull_before_push()
    getattr(policy, event)()
    assert policy.versions == [-1, -1]
    assert policy.must_pull() and policy.must_pull_before_push()
    request, _ = pull(policy, 1, 2)
    assert request.versions == (-1, -1)
    assert not policy.must_pull_before_push() and policy.versions == [1, 2]
