"""StalenessStrategy: before each batch, must the worker pull, and must it wait?

Three modes, from the job's flags:

- sync (default): pull before every batch (the PS answers with parameters only when the
  model moved). After a gradient the PS accepted but has not applied yet, the next pull
  waits for the others' gradients, so each version averages one gradient per worker.
- async (--use_async): pull every ``get_model_steps`` batches; in between the worker
  applies its own gradients to its local copy.
- stale-synchronous parallel (--use_async --staleness_bound s): as async, and a worker
  waits while its clock (batches pushed) is more than ``s`` ahead of the slowest worker
  that holds a task. Workers without a task (dead, preempted, idle) never hold others back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessStrategy:
    use_async: bool = False
    staleness_bound: int = 0
    get_model_steps: int = 1
    sync_version_tolerance: int = 0

    @classmethod
    def from_config(cls, config) -> StalenessStrategy:
        return cls(
            use_async=config.use_async,
            staleness_bound=config.staleness_bound,
            get_model_steps=config.get_model_steps,
            sync_version_tolerance=config.sync_version_tolerance,
        )

    @property
    def bounded(self) -> bool:
        return self.use_async and self.staleness_bound > 0

    @property
    def applies_locally(self) -> bool:
        """Async workers that pull rarely keep training on their own updates in between."""
        return self.use_async and self.get_model_steps > 1

    @property
    def waits_for_version(self) -> bool:
        """Strict sync: after a pending push, wait until the model moves before computing again."""
        return not self.use_async and self.sync_version_tolerance == 0

    def must_pull(self, steps_since_pull: int) -> bool:
        if not self.use_async:
            return True
        return steps_since_pull >= self.get_model_steps

    def must_wait(self, clock: int, slowest_clock: int) -> bool:
        return self.bounded and clock - slowest_clock > self.staleness_bound
