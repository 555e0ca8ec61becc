"""What a parameter server did with a pushed gradient: decided on the PS, acted on by the worker.

It travels as the ``PushOutcome`` enum of ``PushGradientsResponse`` (protos/elasticdl.proto),
member for member by name. The answer's ``reason`` is text for people: nothing decides by it.
"""

from __future__ import annotations

import enum


class PushOutcome(enum.Enum):
    PUSH_OUTCOME_UNSPECIFIED = "unspecified"  # not set: a PS that predates the field
    APPLIED = "applied"  # the update it is part of was applied: it made the answer's version
    ACCEPTED_PENDING = "accepted_pending"  # sync: in the average, waiting for the others' gradients
    REJECTED_STALE = "rejected_stale"  # computed on a version too old (sync), or on no model the PS holds: pull, compute again
    REJECTED_INVALID = "rejected_invalid"  # does not fit the model
    REJECTED_FENCED = "rejected_fenced"  # its task hand-out was taken back (requeued, rolled back): leave it

    @property
    def accepted(self) -> bool:
        return self in (PushOutcome.APPLIED, PushOutcome.ACCEPTED_PENDING)

    @property
    def applied(self) -> bool:
        return self is PushOutcome.APPLIED
