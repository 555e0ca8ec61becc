"""A push that reaches a PS holding no model (relaunched empty while its worker was frozen):
refused as stale, so the worker pulls (which gives the PS its copy) and computes again. Refused
as invalid, the task failed until dropped and the job failed (the simulator, seed 2438)."""

from __future__ import annotations

import pytest

from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.ps_client import PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.consistency import ConsistencyPolicy
from elasticdl.worker.steps import StepKind
from tests.test_ps_server import grads, make_ps


@pytest.mark.parametrize("use_async", [False, True])
def test_a_push_to_a_ps_that_holds_no_model_is_stale_and_changes_nothing(use_async):
    ps = make_ps(use_async=use_async)  # relaunched without a model
    result = ps.push_gradients(grads(), 7, None, batch=BatchPosition(3, 1, 4, 2))
    assert result.outcome is PushOutcome.REJECTED_STALE and "holds no model" in result.reason
    assert not ps.shard.initialized and ps.shard.version == 0
    assert ps.position.records_applied == 0 and ps.position.accepted_mark(3) == 0
    assert ps.stats()[1].pushes_rejected_stale == 1


@pytest.mark.parametrize("use_async", [False, True])
def test_a_worker_told_so_pulls_before_it_pushes_again(use_async):
    """The worker's side: the pull that follows finds the PS empty and refills it (batch_loop)."""
    policy = ConsistencyPolicy(use_async=use_async)
    policy.pulled(policy.pull_request(everything=True), [7])
    policy.batch_started()
    while (push := policy.next_step()).kind is not StepKind.PUSH:  # sync pulls before each batch
        if push.kind is StepKind.PULL:
            policy.pulled(push.pull, [7])
        else:
            policy.computed(finite=True)
    assert policy.pushed({0: PushAnswer(PushOutcome.REJECTED_STALE, 0, "holds no model")}, push) is None
    assert policy.next_step().kind is StepKind.PULL
