"""The policy's step API (next_step and the events), driven as a simulator would: no worker,
no PS, scripted answers. Each mode's sequence of steps, and what a stale refusal, a reconnect
or a task's end make of it."""

from __future__ import annotations

import pytest

from elasticdl.rpc.ps_client import PushAnswer
from elasticdl.rpc.push_outcome import PushOutcome
from elasticdl.worker.consistency import ConsistencyPolicy, TaskTakenBackError
from elasticdl.worker.steps import Gradients, StepKind


class Driver:
    """Carries out steps against scripted PS: each push is APPLIED and makes a version, unless
    ``answers`` holds outcomes for the next pushes; ``slowest`` is the clock the master reports."""

    def __init__(self, policy: ConsistencyPolicy, params_in_answer: bool = False):
        self.policy = policy
        self.version = 0
        self.answers: list[dict[int, PushOutcome]] = []
        self.slowest: list[int] = []  # per WAIT: the slowest clock (default: this worker's)
        self.params_in_answer = params_in_answer
        self.log: list[str] = []
        self.pushed_versions: list[tuple[int, ...]] = []
        self.policy.pulled(policy.pull_request(everything=True), [0] * policy.num_ps)

    def run(self) -> list[str]:
        start = len(self.log)
        while (step := self.policy.next_step()).kind is not StepKind.DONE:
            self.log.append(self._carry_out(step))
            assert len(self.log) - start < 50, f"no end to the steps: {self.log[start:]}"
        return self.log[start:]

    def batch(self) -> list[str]:
        self.policy.batch_started()
        return self.run()

    def task_end(self) -> list[str]:
        self.policy.task_ending()
        return self.run()

    def _answer(self, to_ps) -> dict[int, PushAnswer]:
        script = self.answers.pop(0) if self.answers else {}
        out = {}
        for ps in to_ps:
            outcome = script.get(ps, PushOutcome.APPLIED)
            if outcome is PushOutcome.APPLIED:
                self.version += 1
            params = {} if self.params_in_answer and outcome.applied else None
            out[ps] = PushAnswer(outcome, self.version, "scripted", params)
        return out

    def _carry_out(self, step) -> str:
        policy = self.policy
        if step.kind is StepKind.WAIT:
            slowest = self.slowest.pop(0) if self.slowest else policy.clock
            policy.clock_reported(policy.clock, slowest)
            return "wait"
        if step.kind is StepKind.PULL:
            policy.pulled(step.pull, [self.version] * policy.num_ps)
            return "pull*" if set(step.pull.versions) == {-1} else "pull"
        if step.kind is StepKind.COMPUTE:
            policy.computed(True)
            return "compute+keep" if step.keep else "compute"
        if step.kind is StepKind.SETTLE:
            policy.settled(self._answer(range(policy.num_ps)))
            return "settle"
        assert min(step.versions) >= 0, "a push must never name version -1"
        self.pushed_versions.append(step.versions)
        if step.background:
            policy.started_in_background(step)
            return "push-bg" + ("+pull" if step.pull is not None else "")
        policy.pushed(self._answer(step.to_ps), step)
        name = {Gradients.BATCH: "push", Gradients.ACCUMULATED: "push-acc", Gradients.AGAIN: "push-again"}
        return name[step.gradients] + ("" if len(step.to_ps) == policy.num_ps else f"{list(step.to_ps)}")


def test_sync_pulls_computes_pushes_and_a_push_answered_with_parameters_replaces_the_pull():
    plain = Driver(ConsistencyPolicy(num_ps=2))
    assert plain.batch() == ["pull", "compute", "push"]
    assert plain.batch() == ["pull", "compute", "push"]
    answered = Driver(ConsistencyPolicy(num_ps=2), params_in_answer=True)
    assert answered.batch() == ["pull", "compute", "push"]
    assert answered.batch() == ["compute", "push"]
    assert answered.policy.clock == 2


def test_sync_stale_refusal_pulls_computes_again_and_pushes_to_that_ps_only():
    d = Driver(ConsistencyPolicy(num_ps=2))
    d.answers = [{1: PushOutcome.REJECTED_STALE}]
    assert d.batch() == ["pull", "compute", "push", "pull", "compute", "push[1]"]
    assert d.policy.clock == 1


def test_a_gradient_refused_as_stale_max_push_tries_times_is_dropped():
    d = Driver(ConsistencyPolicy(max_push_tries=3))
    d.answers = [{0: PushOutcome.REJECTED_STALE}] * 3
    assert d.batch() == ["pull", "compute", "push"] * 3
    assert d.policy.dropped == 1 and d.policy.clock == 0
    assert d.batch() == ["pull", "compute", "push"]  # the next batch starts afresh


def test_async_pulls_every_get_model_steps_batches():
    d = Driver(ConsistencyPolicy(use_async=True, get_model_steps=2))
    steps = [d.batch() for _ in range(4)]
    assert steps == [["compute", "push"], ["compute", "push"], ["pull", "compute", "push"], ["compute", "push"]]


def test_ssp_waits_while_ahead_of_the_slowest_then_pulls():
    d = Driver(ConsistencyPolicy(use_async=True, staleness_bound=1))
    d.batch()
    d.slowest = [-5, -5, 1]
    assert d.batch() == ["wait", "wait", "wait", "pull", "compute", "push"]


def test_accumulated_pushes_every_push_steps_batches_and_at_the_task_end():
    d = Driver(ConsistencyPolicy(use_async=True, push_steps=2))
    assert d.batch() == ["compute+keep"]
    assert d.batch() == ["compute+keep", "push-acc"]
    assert d.batch() == ["pull", "compute+keep"]
    assert d.task_end() == ["push-acc"]
    assert d.policy.unpushed == 0 and d.task_end() == []


def test_overlap_settles_the_exchange_in_flight_before_the_next_one_and_at_the_task_end():
    d = Driver(ConsistencyPolicy(use_async=True, overlap=True))
    assert d.batch() == ["compute", "push-bg+pull"]
    assert d.policy.in_flight == 1
    assert d.batch() == ["compute", "settle", "push-bg+pull"]
    assert d.task_end() == ["settle"]
    assert d.policy.in_flight == 0 and d.policy.clock == 2


def test_overlap_in_ssp_settles_before_it_waits():
    d = Driver(ConsistencyPolicy(use_async=True, overlap=True, staleness_bound=1))
    d.batch()
    d.slowest = [-5, -5]
    assert d.batch() == ["wait", "settle", "wait", "wait", "pull", "compute", "push-bg+pull"]


def test_an_exchange_refused_as_stale_is_pushed_again_as_it_is():
    d = Driver(ConsistencyPolicy(use_async=True, overlap=True))
    d.batch()
    d.answers = [{0: PushOutcome.REJECTED_STALE}]
    assert d.batch() == ["compute", "settle", "pull", "push-again", "push-bg+pull"]


@pytest.mark.parametrize("mode, expected", [
    (dict(), ["pull*", "compute", "push"]),
    (dict(use_async=True), ["pull*", "compute", "push"]),
    (dict(use_async=True, staleness_bound=2), ["pull*", "compute", "push"]),
    (dict(use_async=True, push_steps=2), ["pull*", "push-acc"]),
    (dict(use_async=True, overlap=True), ["pull*", "push-bg+pull"]),
])
def test_a_reconnect_before_a_push_pulls_everything_first_in_every_mode(mode, expected):
    d = Driver(ConsistencyPolicy(num_ps=2, **mode))
    if d.policy.accumulates:
        d.batch()
    d.policy.batch_started()
    for _ in range(10):
        step = d.policy.next_step()
        if step.kind is StepKind.PUSH:
            break
        d.log.append(d._carry_out(step))
    d.policy.ps_reconnected()  # the push raised UNAVAILABLE: the worker retries the step
    start = len(d.log)
    d.run()
    assert d.log[start:] == expected
    assert all(min(v) >= 0 for v in d.pushed_versions)


def test_a_fenced_answer_leaves_the_task_and_drops_what_was_not_pushed():
    d = Driver(ConsistencyPolicy(use_async=True, push_steps=2))
    d.batch()
    d.policy.batch_started()
    d.answers = [{0: PushOutcome.REJECTED_FENCED}]
    with pytest.raises(TaskTakenBackError):
        d.run()
    d.policy.task_left()
    assert d.policy.unpushed == 0 and d.policy.next_step().kind is StepKind.DONE
    d.policy.task_started()
    assert d.batch() == ["pull*", "compute+keep"]
