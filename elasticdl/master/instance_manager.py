"""Which workers should run: the scaling and relaunch policy, as pure decisions.

The instance manager keeps the desired number of workers. Each *slot* is one wanted
worker; the process filling it has an index, and a relaunch gets a new index (so a late
report from the old process can never be mistaken for the new one's). It returns
decisions; the job loop carries them out on the backend.

- A worker that crashes (non-zero exit) is relaunched in its slot, up to
  ``relaunch_limit`` times per slot; one more crash ends the job with its error.
- A worker that was preempted (killed by a signal, or left cleanly when nobody asked
  it to) is a scale-down, not a failure: its slot is refilled without counting a crash.
- Scaling down stops low-priority workers first (the newest first); scaling up adds slots
  whose priorities keep ``ceil(f * n)`` of ``n`` workers high (``--worker_pod_priority f``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elasticdl.config.priority import high_count


class Priority(enum.StrEnum):
    HIGH = "high"
    LOW = "low"


@dataclass
class Slot:
    slot_id: int
    index: int  # the worker process filling it now
    priority: Priority
    crashes: int = 0
    stopping: bool = False  # asked to leave (scale-down): its exit ends the slot
    ended: bool = False  # there when training ended, then reopened: may leave as told (END)


@dataclass(frozen=True)
class Launch:
    index: int
    priority: Priority


@dataclass(frozen=True)
class Stop:
    index: int


@dataclass(frozen=True)
class GiveUp:
    error: str


Decision = Launch | Stop | GiveUp


class InstanceManager:
    def __init__(self, desired: int, high_fraction: float = 1.0, relaunch_limit: int = 3):
        self.fraction = high_fraction  # --worker_pod_priority: the share of high-priority workers
        self.relaunch_limit = relaunch_limit
        self.desired = 0
        self._slots: dict[int, Slot] = {}  # by process index
        self._next_index = 0
        self._next_slot = 0
        self.relaunches = 0
        self.preemptions = 0
        self._initial = desired
        self._ended: list[Slot] = []  # whose workers left at the job's end (reopen fills them again)

    def initial(self) -> list[Decision]:
        return self.scale(self._initial)

    @property
    def live_indices(self) -> list[int]:
        return sorted(i for i, s in self._slots.items() if not s.stopping)

    def priority_of(self, index: int) -> Priority | None:
        slot = self._slots.get(index)
        return slot.priority if slot else None

    def scale(self, desired: int) -> list[Decision]:
        if desired < 0:
            raise ValueError(f"the number of workers must be 0 or more. Received: {desired}")
        self.desired = desired
        live = [s for s in self._slots.values() if not s.stopping]
        decisions: list[Decision] = []
        if desired < len(live):
            # Low priority first, newest first within a priority.
            order = sorted(live, key=lambda s: (s.priority == Priority.HIGH, -s.slot_id))
            for slot in order[: len(live) - desired]:
                slot.stopping = True
                decisions.append(Stop(slot.index))
        else:
            highs = sum(s.priority == Priority.HIGH for s in live)
            want_high = high_count(self.fraction, desired)
            for _ in range(desired - len(live)):
                priority = Priority.HIGH if highs < want_high else Priority.LOW
                highs += priority == Priority.HIGH
                decisions.append(self._fill(Slot(self._next_slot, -1, priority)))
                self._next_slot += 1
        return decisions

    def on_exit(self, index: int, returncode: int, log_tail: str = "", job_done: bool = False) -> list[Decision]:
        slot = self._slots.pop(index, None)
        if slot is None or slot.stopping:
            return []  # asked to leave: nothing to refill
        if job_done:
            self._ended.append(slot)  # nothing to refill, unless the job reopens
            return []
        if slot.ended and returncode == 0:
            slot.ended = False  # it left on the END it got before the job reopened
            return [self._fill(slot)]
        if returncode < 0 or returncode == 0:
            # Killed by a signal (preempted, evicted, OOM-killed by the OS) or left cleanly on
            # a SIGTERM nobody here sent: capacity went away, the worker did nothing wrong.
            self.preemptions += 1
            return [self._fill(slot)]
        slot.crashes += 1
        if slot.crashes > self.relaunch_limit:
            return [GiveUp(
                f"worker {index} crashed {slot.crashes} times in the same slot "
                f"(--relaunch_on_worker_failure={self.relaunch_limit}); its last lines:\n{log_tail.rstrip()}"
            )]
        self.relaunches += 1
        return [self._fill(slot)]

    def reopen(self) -> list[Decision]:
        """Training ended, then had to go on (a PS was lost before the model was saved): the
        slots whose workers left at the end are filled again; a worker still there may leave
        on the END it got, and its exit refills its slot (not counted as a preemption)."""
        for slot in self._slots.values():
            slot.ended = True
        ended, self._ended = self._ended, []
        return [self._fill(slot) for slot in ended]

    def _fill(self, slot: Slot) -> Launch:
        slot.index = self._next_index
        self._next_index += 1
        self._slots[slot.index] = slot
        return Launch(slot.index, slot.priority)
