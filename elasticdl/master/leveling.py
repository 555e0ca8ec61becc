"""When a sync job levels its shards to one version (the controller's ``LevelVersions``).

The shards of a sync job group the same gradients into versions on their own: after faults
(a live-worker count that reached them at different points of their streams, a push refused
as stale by one and taken by another, a retry one PS had taken already) they can count
different versions for the same updates. Once training is over and 0 live workers were told
(no gradient waits in an average any more), every shard moves up to the highest one's version,
its parameters unchanged, before the final epoch end reads the model: the job ends, and is
cut, at one version (docs/consistency.md, "One version at the end"). Pure: no I/O, the
controller's clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A PS relaunched empty waits for a waiting worker's refill (it looks every 5 s); one that nobody
# can refill (no worker built the model) ends the job unleveled after this long.
LEVEL_PATIENCE_SECONDS = 30.0


@dataclass
class Leveling:
    """The controller's leveling state: due once, again after a PS relaunch or more training."""

    clock: Callable[[], float]
    done: bool = False  # leveled (or given up after LEVEL_PATIENCE_SECONDS)
    held: bool = False  # asked, or refused: not asked again before the next Tick
    refused_since: float | None = None  # the first answer that found a PS away or empty

    def due(self, training_over: bool, zero_told: bool) -> bool:
        """Ask now? Call after each event; True marks it asked (its answer comes back first)."""
        if not training_over:
            self.done, self.refused_since = False, None  # training goes on (or again): level at its end
            return False
        if self.done or self.held or not zero_told:
            return False
        self.held = True
        return True

    def leveled(self) -> None:
        self.done = True

    def refused(self) -> None:
        """A PS did not answer, held pending gradients, or holds no model: asked again at the
        next Tick, until LEVEL_PATIENCE_SECONDS passed since the first refusal."""
        now = self.clock()
        self.held = True
        self.refused_since = now if self.refused_since is None else self.refused_since
        if now - self.refused_since >= LEVEL_PATIENCE_SECONDS:
            logger.warning("the parameter servers could not be leveled to one version for %.0f s (a PS away, or "
                           "relaunched empty with no worker to refill it): the job ends with them as they are",
                           now - self.refused_since)
            self.done = True

    def tick(self) -> None:
        self.held = False

    def ps_relaunched(self) -> None:
        """It may come back at another version (and a rollback trains again)."""
        self.done = False
