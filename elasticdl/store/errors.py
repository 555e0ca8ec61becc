"""What the state store raises, and how long a call retries before it does.

Every store call retries transient failures with exponential backoff (:class:`RetryPolicy`:
0.05 s doubling to 1 s, 5 s in all) and then raises :class:`StoreUnavailableError`.
:class:`LeadershipError` and :class:`LedgerConflictError` are never retried: another master
holds the job, and this one must stop.

Kept apart from :mod:`elasticdl.store.api` so that the lease code
(:mod:`elasticdl.store.leadership`), which the contract uses, can raise and catch them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from elasticdl.errors import JobFailure


class StateStoreError(JobFailure, RuntimeError):
    """Base class of the state store's errors."""


class LeadershipError(StateStoreError):
    """Another master holds the job's leader lock, or this master lost it."""


class LedgerConflictError(StateStoreError):
    """The stored ledger is not the one the write expected; nothing was written."""

    def __init__(self, message: str, current_revision: int = 0, stored_seq: int = -1):
        super().__init__(message)
        self.current_revision = current_revision
        self.stored_seq = stored_seq


class StoreUnavailableError(StateStoreError):
    """The store did not answer within the retry budget."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``initial_delay`` growing by ``multiplier`` up to ``max_delay``,
    for at most ``budget`` seconds in all (0: one attempt)."""

    initial_delay: float = 0.05
    max_delay: float = 1.0
    multiplier: float = 2.0
    budget: float = 5.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_delay
        while True:
            yield delay
            delay = min(delay * self.multiplier, self.max_delay)
