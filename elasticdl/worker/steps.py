"""The steps of a worker's batch: what ``ConsistencyPolicy.next_step()`` tells the worker to do.

One batch loop carries them out in every mode (worker/batch_loop.py); a simulator may carry
them out against a numpy model instead (docs/consistency.md, the policy's docstring). Plain values: no TensorFlow, no gRPC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class PullRequest:
    """What to ask each PS for in a pull."""

    versions: tuple[int, ...]  # the version held of each PS; -1: send every parameter
    wait_for_newer: tuple[bool, ...]  # per PS: answer once the model moved past versions[i]


class StepKind(enum.Enum):
    WAIT = "wait"  # SSP: report the clock to the master, then ``clock_reported(clock, slowest)``
    SETTLE = "settle"  # overlap: take the answers of the exchange in flight, then ``settled(...)``
    PULL = "pull"  # pull ``step.pull``, load it, then ``pulled(request, versions)``
    COMPUTE = "compute"  # compute the batch's gradients on the parameters held, then ``computed(finite)``
    PUSH = "push"  # push gradients to ``step.to_ps``, then ``pushed(answers)`` (background: ``exchange_started()``)
    DONE = "done"  # nothing left for this batch (or, after ``task_ending()``, for the task)


class Gradients(enum.Enum):
    """Which gradients a PUSH sends."""

    BATCH = "batch"  # the ones COMPUTE just made
    ACCUMULATED = "accumulated"  # the mean of those kept since the last push (--push_steps)
    AGAIN = "again"  # the last push's, again, to the PS that refused them as stale


@dataclass(frozen=True)
class Step:
    """One thing to do. Fields other than ``kind`` matter only for the kinds they name."""

    kind: StepKind
    pull: PullRequest | None = None  # PULL: the request; a background PUSH: the pull after it (None: none)
    to_ps: tuple[int, ...] = ()  # PUSH: the PS to send to
    versions: tuple[int, ...] = ()  # PUSH: the version of each PS the gradients were computed on
    gradients: Gradients = Gradients.BATCH  # PUSH: which ones
    want_parameters: bool = False  # PUSH: ask each PS to answer with the version it made
    background: bool = False  # PUSH: overlap: run it (and ``pull``) while the next batch computes
    keep: bool = False  # COMPUTE: apply the gradients locally and keep them for a later push
    apply_locally: bool = False  # PUSH: apply these gradients to the local copy too (async between pulls)


DONE = Step(StepKind.DONE)
COMPUTE = Step(StepKind.COMPUTE)
WAIT = Step(StepKind.WAIT)
SETTLE = Step(StepKind.SETTLE)
