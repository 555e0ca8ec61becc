"""BatchSteps: the order of a worker's steps for one batch, in every mode; ConsistencyPolicy's base.

The consistency rules (worker/consistency.py: when to pull, wait, what a push's answer means)
decide; this class turns them into one sequence of steps (worker/steps.py) that one loop
carries out, so plain pushes, accumulated pushes (--push_steps) and overlap are variants of
the sequence, not separate code paths:

- plain (sync, async, SSP): [WAIT...] [PULL] COMPUTE PUSH; a stale refusal: PULL COMPUTE PUSH
  to the PS that refused (sync);
- --push_steps n: [WAIT...] [PULL] COMPUTE(keep) and, every n-th batch, PUSH(accumulated);
- overlap: [WAIT... (SETTLE when held back)] [PULL] COMPUTE [SETTLE] PUSH(background).

A task's end (``task_ending``) flushes: SETTLE the exchange in flight, PUSH what is
accumulated. After a PS reconnect (``ps_reconnected``) the next step is a PULL of everything
before any COMPUTE or PUSH; a plain batch's gradients not yet taken are computed again, while
gradients already applied to the local copy (accumulated, in an exchange) are pushed again as
they are: the PS takes a batch position once (ps/data_position.py). Refused as stale, those
are pushed again after a pull, named by the versions it brought. Each push's gradients are
tried ``max_push_tries`` times at most, then dropped (``dropped`` counts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticdl.worker.steps import COMPUTE, DONE, SETTLE, WAIT, Gradients, Step, StepKind

if TYPE_CHECKING:
    from elasticdl.rpc.ps_client import PushAnswer

MAX_PUSH_TRIES = 64  # a sync gradient refused as stale this many times in a row is dropped


@dataclass
class _Outbox:
    """The gradients of the last push that some PS did not take yet."""

    to_ps: set[int]
    versions: tuple[int, ...]  # (): those held when pushed again (refused as stale: pull first)
    applied_locally: bool  # accumulated or overlapped: never computed again, pushed again as they are
    accumulated: bool
    ends_batch: bool  # the current batch's (plain, or its accumulated push), not an earlier exchange's


class BatchSteps:
    """The step sequence; the rules it asks (``must_pull`` ...) are ConsistencyPolicy's."""

    def _init_steps(self, max_push_tries: int = MAX_PUSH_TRIES) -> None:
        self.max_push_tries = max_push_tries
        self.dropped = 0  # pushes given up after max_push_tries stale refusals
        self._in_batch = False
        self._clock_ok = True  # SSP: the clock was reported for this batch and is within the bound
        self._held_back = False  # SSP: the last report said wait
        self._has_grads = False  # COMPUTE made gradients that no PUSH took yet
        self._computed_on: tuple[int, ...] = ()
        self._outbox: _Outbox | None = None
        self._only_to: set[int] | None = None  # a stale plain batch computed again: push to these only
        self._tries = 0  # pushes of the current gradients refused as stale
        self._accumulated_due = False
        self._flushing = False
        self._batch_pulled = False  # a PULL was made for the current batch (ConsistencyPolicy.pulled)

    # ------------------------------------------------------------ the step

    def next_step(self) -> Step:
        """What the worker does next for the current batch (or the task's end)."""
        if self._outbox is not None and not self.in_flight:
            step = self._push_again()
            if step is not None:
                return step
        if not self._in_batch:
            if self._flushing and self.in_flight:
                return SETTLE
            if self._flushing and self.unpushed:
                return self._pull_first() or self._push(Gradients.ACCUMULATED)
            return DONE
        if not self._clock_ok:
            return SETTLE if self._held_back and self.in_flight else WAIT
        if self._accumulated_due:
            return self._pull_first() or self._push(Gradients.ACCUMULATED)
        if not self._has_grads:
            # Once pulled for this batch, only a stale refusal or a reconnect pulls again.
            if self._refresh or self._stale or (not self._batch_pulled and self.must_pull()):
                return Step(StepKind.PULL, pull=self.pull_request(everything=self._refresh))
            return Step(StepKind.COMPUTE, keep=True) if self.accumulates else COMPUTE
        if self.overlap:
            if self.in_flight:
                return SETTLE
            pull = self.pull_request() if self.pulls_after_push() else None
            return self._pull_first() or Step(
                StepKind.PUSH, pull=pull, to_ps=tuple(range(self.num_ps)), versions=self._computed_on,
                background=True, apply_locally=True)
        return self._push(Gradients.BATCH)

    def _pull_first(self) -> Step | None:
        """After a reconnect, gradients already made are pushed only after a pull of everything."""
        return Step(StepKind.PULL, pull=self.pull_request(everything=True)) if self._refresh else None

    def _push(self, gradients: Gradients) -> Step:
        to_ps = tuple(sorted(self._only_to)) if self._only_to else tuple(range(self.num_ps))
        versions = self._computed_on if gradients is Gradients.BATCH else tuple(self.versions)
        return Step(StepKind.PUSH, to_ps=to_ps, versions=versions, gradients=gradients,
                    want_parameters=self.wants_push_parameters and gradients is Gradients.BATCH,
                    apply_locally=gradients is Gradients.BATCH and self.applies_locally)

    def _push_again(self) -> Step | None:
        """The last push's gradients, to the PS that did not take them (None: nothing to do now)."""
        outbox = self._outbox
        if not outbox.applied_locally:
            # A plain batch: computed again on fresh parameters (sync refuses the old ones).
            self._only_to = outbox.to_ps
            self._has_grads = False
            self._outbox = None
            return None
        if self._refresh or self._stale:  # learn where the PS are first (a reconnect: everything)
            return Step(StepKind.PULL, pull=self.pull_request(everything=self._refresh))
        # Refused as stale: named by the versions just pulled (the same ones would be refused again).
        versions = outbox.versions or tuple(self.versions)
        return Step(StepKind.PUSH, to_ps=tuple(sorted(outbox.to_ps)), versions=versions, gradients=Gradients.AGAIN)

    # ------------------------------------------------------------ what happened

    def batch_started(self) -> None:
        """A batch's features are ready: its steps begin."""
        self._in_batch = True
        self._clock_ok = not self.bounded
        self._held_back = False
        self._has_grads = False
        self._only_to = None
        self._tries = 0
        self._batch_pulled = False

    def clock_reported(self, clock: int, slowest_clock: int) -> bool:
        """WAIT's answer (this worker's clock and the slowest one's, by the master); True: wait
        (with an exchange in flight the next step settles it; else pause, then WAIT again)."""
        wait = self.must_wait(clock, slowest_clock)
        self._clock_ok = not wait
        self._held_back = wait
        if wait and not self.in_flight:
            self.held_back()
            self._batch_pulled = False  # what the settled exchange pulled may miss what was pushed meanwhile
        return wait

    def computed(self, finite: bool) -> None:
        """COMPUTE's outcome: False when the loss or gradients held NaN/Inf (the batch is skipped)."""
        if not finite:
            self._end_batch()
            return
        self._computed_on = tuple(self.versions)
        if self.accumulates:
            self.batch_accumulated()  # the worker applied them locally and kept them
            self._accumulated_due = self.push_due()
            if not self._accumulated_due:
                self._end_batch()
            return
        self._has_grads = True

    def pushed(self, answers: Mapping[int, PushAnswer], step: Step) -> Gradients | None:
        """A synchronous PUSH's answers (raises as ``push_answered``). Returns what every PS
        took: ``Gradients.BATCH`` (a batch's), ``Gradients.ACCUMULATED``, or None (not yet, or
        given up: ``dropped`` grew)."""
        retry = self.push_answered(answers)
        if step.gradients is not Gradients.AGAIN:
            self._outbox = _Outbox(set(step.to_ps), step.versions, step.gradients is not Gradients.BATCH,
                                   step.gradients is Gradients.ACCUMULATED, self._in_batch)
        outbox = self._outbox
        outbox.to_ps = retry
        outbox.versions = ()  # if pushed again: after a pull, named by the versions then held
        self._tries += 1
        if retry and self._tries < self.max_push_tries:
            return None
        self._outbox = None
        self._tries = 0
        if outbox.accumulated:
            self.accumulation_pushed()  # dropped or not: the worker clears its accumulator
            self._accumulated_due = False
        elif not retry:
            self.batch_pushed()
        if outbox.ends_batch:
            self._end_batch()
        if retry:
            self.dropped += 1
            return None
        return Gradients.ACCUMULATED if outbox.accumulated else Gradients.BATCH

    def started_in_background(self, step: Step) -> None:
        """A background PUSH began (overlap): its batch's steps are over; SETTLE takes its answers."""
        self.exchange_started()
        self._end_batch()

    def settled(self, answers: Mapping[int, PushAnswer]) -> bool:
        """SETTLE's answers of the exchange's push (raises as ``push_answered``, and then the
        exchange is dropped). True: every PS took them (then load the exchange's pull, if any)."""
        try:
            retry = self.push_answered(answers)
        except BaseException:
            self.exchange_dropped()
            raise
        self.exchange_settled()
        if retry:
            self._outbox = _Outbox(retry, (), True, False, False)  # pulled first, then pushed again
            self._tries = 1
            return False
        self.batch_pushed()
        return True

    def task_ending(self) -> None:
        """The task's records are trained (or it is left on SIGTERM): flush before the report."""
        self._end_batch()
        self._flushing = True
        self._tries = 0

    def task_left(self) -> None:
        """The task failed or was taken back: whatever was not pushed is dropped (trained again)."""
        if self.in_flight:
            self.exchange_dropped()
        if self.unpushed:
            self.accumulation_dropped()
        self._outbox = None
        self._accumulated_due = False
        self._end_batch()
        self._flushing = False

    def _end_batch(self) -> None:
        self._in_batch = False
        self._has_grads = False
        self._only_to = None
        self._clock_ok = True

    def _forget_unsent(self) -> None:
        """A reconnect: a plain batch's gradients not taken are computed again after the pull."""
        if self._outbox is not None and not self._outbox.applied_locally:
            self._only_to = self._outbox.to_ps
            self._outbox = None
        if self._in_batch and not self.accumulates and not self.overlap:
            self._has_grads = False
