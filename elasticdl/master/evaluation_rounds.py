"""When evaluation rounds run, and on which snapshot: a pure part of the controller.

An epoch's end queues a round that evaluates the model as the epoch left it: its snapshot is
asked for at once (``TakeSnapshot``), even while another round runs, up to
``MAX_FROZEN_ROUNDS`` held ahead. A round starts once no other runs, on its snapshot (asked for
then, if it has none); ``--evaluation_steps`` rounds start when due. A PS death suspends the
running round and loses the snapshots held ahead: the round runs again on a fresh snapshot.
No PS is called here: every snapshot is a decision whose answer (``SnapshotTaken`` or
``SnapshotFailed``) comes back as an event. A failed one is not asked again before the next
``Tick`` (asked again at once, the job's feed would never get back to polling the PS's exit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from elasticdl.master.evaluation_service import EvaluationService, FrozenSnapshot
from elasticdl.master.events import (
    Decision,
    DropSnapshot,
    FireEpochEnd,
    RecordEvaluation,
    SnapshotFailed,
    SnapshotTaken,
    TakeSnapshot,
)

logger = logging.getLogger(__name__)

# Epoch ends whose snapshot is taken at once while rounds queue up behind a slow one; later
# ones take theirs when they start. With the running round's, that stays below the PS's limit
# (MAX_SNAPSHOTS in elasticdl/ps/server.py evicts the oldest past 4).
MAX_FROZEN_ROUNDS = 2


@dataclass
class _Queued:
    reason: str
    epoch: int | None  # the epoch whose end it evaluates (None: --evaluation_steps, evaluate)
    frozen: FrozenSnapshot | None = None
    asked: int = 0  # the round id of the snapshot asked for it, not answered yet


class EvaluationRounds:
    def __init__(self, evaluation: EvaluationService, evaluation_steps: int, fires_epoch_ends: bool):
        self.evaluation = evaluation
        self.evaluation_steps = evaluation_steps
        self.fires_epoch_ends = fires_epoch_ends  # train: a round's result fires its epoch's end
        self._queue: list[_Queued] = []
        self._round_epochs: dict[int, int | None] = {}  # running or finished round -> its epoch
        self._starting: _Queued | None = None  # its snapshot is asked for, to start it on the answer
        self._restarting = 0  # the snapshot asked for the suspended round
        self._held = False  # a snapshot failed: none asked again before the next Tick
        # The job's model version when the last round was asked for: "every N versions" counts
        # from it. Counted from a round's snapshot version alone (the lowest PS's), a PS that
        # restarted behind the others made every round due again at once, forever.
        self._asked_at_version = 0

    @property
    def idle(self) -> bool:
        """Nothing queued, starting or running."""
        return not self._queue and self._starting is None and not self.evaluation.busy

    def queue(self, reason: str, epoch: int | None) -> list[Decision]:
        """A round to run after the running one; an epoch's is frozen now when it may be."""
        entry = _Queued(reason, epoch)
        self._queue.append(entry)
        ahead = sum(q.frozen is not None or q.asked != 0 for q in self._queue)
        if epoch is None or self._held or ahead >= MAX_FROZEN_ROUNDS:
            return []  # it takes its snapshot when it starts
        entry.asked = self.evaluation.reserve_round()
        return [TakeSnapshot(entry.asked)]

    def ps_died(self) -> list[Decision]:
        """The running round's snapshot and those held ahead died with the PS."""
        if self.evaluation.busy:
            self.evaluation.suspend()  # run again once the PS is back
        decisions: list[Decision] = []
        for entry in self._queue:
            if entry.frozen is not None:  # such a round takes its snapshot when it starts
                decisions.append(DropSnapshot(entry.frozen.round_id, best_effort=True))
                entry.frozen = None
        return decisions

    def tick(self) -> None:
        self._held = False

    def on_snapshot(self, event: SnapshotTaken | SnapshotFailed) -> list[Decision]:
        round_id = event.round_id
        queued = next((q for q in self._queue if q.asked == round_id), None)
        if queued is not None:
            queued.asked = 0
        starting = self._starting if self._starting is not None and self._starting.asked == round_id else None
        if starting is not None:
            self._starting = None
        restarting = self._restarting == round_id
        if restarting:
            self._restarting = 0
        if isinstance(event, SnapshotFailed):
            self._held = True  # a PS is restarting: a later Tick asks again
            if starting is not None:
                # Still the next round to run, asked again at a later Tick: left marked as waiting
                # for this answer, it was never asked again, and the job waited for its final
                # evaluation forever (a PS killed at an epoch's end; CI's hang of the chaos test).
                starting.asked = 0
                self._queue.insert(0, starting)
            return [DropSnapshot(round_id, best_effort=True)]  # a PS that did take it frees it
        frozen = FrozenSnapshot(round_id, event.version)
        if queued is not None:
            queued.frozen = frozen
        elif starting is not None:
            self._start(starting, frozen)
        elif restarting:
            lost = self.evaluation.restart(frozen)
            self._round_epochs[round_id] = self._round_epochs.pop(lost, None)
            logger.warning("a PS restarted during evaluation round %d: evaluating again", lost)
            return [DropSnapshot(lost, best_effort=True)]  # still held by the PS that did not restart
        else:
            return [DropSnapshot(round_id, best_effort=True)]  # nobody waits for it any more
        return []

    def advance(self, model_version: int, training_over: bool = False) -> list[Decision]:
        """What is due; ``training_over``: no round every N versions any more (the final round
        evaluates the last model; the versions do not move, a periodic round would be the last)."""
        evaluation = self.evaluation
        if evaluation.busy and evaluation.current.suspended:
            if self._restarting or self._held:
                return []
            self._restarting = evaluation.reserve_round()
            return [TakeSnapshot(self._restarting)]
        decisions: list[Decision] = []
        result = evaluation.poll()
        if result is not None:
            decisions.append(RecordEvaluation(result))
            epoch = self._round_epochs.pop(result.round_id, None)
            if epoch is not None and self.fires_epoch_ends:
                # The callbacks see the parameters that were evaluated, not newer ones.
                decisions.append(FireEpochEnd(epoch, dict(result.metrics), snapshot=result.round_id))
            decisions.append(DropSnapshot(result.round_id))
        if evaluation.busy or self._starting is not None:
            return decisions
        if self._queue:
            head = self._queue[0]
            if head.frozen is not None:
                self._queue.pop(0)
                self._start(head, head.frozen)
            elif not head.asked and not self._held:
                self._queue.pop(0)
                decisions += self._ask_to_start(head)
        elif (not self._held and not training_over and evaluation.due(model_version)
              and model_version >= self._asked_at_version + self.evaluation_steps):
            self._asked_at_version = model_version
            decisions += self._ask_to_start(_Queued(f"every {self.evaluation_steps} versions", None))
        return decisions

    def _ask_to_start(self, entry: _Queued) -> list[Decision]:
        entry.asked = self.evaluation.reserve_round()
        self._starting = entry
        return [TakeSnapshot(entry.asked)]

    def _start(self, entry: _Queued, frozen: FrozenSnapshot) -> None:
        self._round_epochs[self.evaluation.start(entry.reason, frozen).round_id] = entry.epoch
