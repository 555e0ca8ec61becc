"""Feeding the controller: one event, then the answers of its decisions, until none is pending.

The job's executor (``elasticdl.master.job``) and the simulator (``elasticdl.sim``) both run the
controller through ``feed``, so that what the simulator explores is what a job does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from elasticdl.errors import JobFailure

# Far above what one event leads to (a PS death: a relaunch, fences, a ledger save, ...), far
# below a loop that never ends: a controller answering itself forever is a bug, and a job that
# spins on it never polls its roles again.
MAX_STEPS_PER_FEED = 10_000


class FeedLivelock(JobFailure, RuntimeError):
    """The controller and the executor kept answering each other: the job would spin forever."""


def feed(controller, event, carry_out: Callable[[object], Iterable], max_steps: int = MAX_STEPS_PER_FEED) -> int:
    """Step ``controller`` with ``event``, then with every event ``carry_out(decision)`` answers,
    in order, until none is pending or the controller reached its outcome; the steps taken.

    >>> feed(controller, Tick(), job.carry_out)  # doctest: +SKIP
    3
    """
    pending = deque([event])
    steps = 0
    while pending and controller.outcome is None:
        steps += 1
        if steps > max_steps:
            raise FeedLivelock(
                f"the controller took {max_steps} events without settling (the last: {pending[0]!r}); "
                "this is a bug in ElasticDL, please report it with the master's log"
            )
        for decision in controller.step(pending.popleft()):
            pending.extend(carry_out(decision))
    return steps
