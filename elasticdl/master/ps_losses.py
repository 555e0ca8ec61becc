"""How the controller meets a parameter server lost: dead, or silent (frozen) and killed.

A part of ``Controller`` (elasticdl/master/controller.py), in its own module. A PS lost while
training runs is relaunched (from the latest cut, or its shard promoted from a backup with
--ps_replicas). So is a PS lost after the last task but before the job saved the model (the
final stats and the final checkpoint): the model on the PS is the job's only copy of what was
trained since the last cut, so the job reopens. The workers that left start again, and what the
recovery rolls back is trained again; the model the job saves then holds every record once.
"""

from __future__ import annotations

import logging

from elasticdl.launch.exits import ProcessExit
from elasticdl.master.events import (
    Decision,
    Fail,
    Finish,
    PromotionFailed,
    RelaunchPS,
    ReplacePS,
    describe_exit,
)

logger = logging.getLogger(__name__)

# A PS that answers no probe this long is frozen or hung (a gray failure): it is killed, and
# relaunched like a PS that died. Long enough for a PS busy writing a large checkpoint.
PS_SILENT_SECONDS = 60.0


SHARD_LOST = "without --checkpoint_dir its shard of the model is lost"


def shard_lost(exit_: ProcessExit, why: str = "") -> str:
    """The job's error when a PS died after the last task and no replica or cut keeps its shard
    (refilled, the shard would hold a new worker's untrained copy)."""
    return (f"{describe_exit(exit_, 'died')} after the last task, before the job saved the model"
            f"{', and ' + why if why else ''}: {SHARD_LOST}. Run the job with --checkpoint_dir (and "
            "--ps_replicas 1 so that a PS death costs nothing)")


class PSLosses:
    """The controller's handling of lost parameter servers (a part of ``Controller``)."""

    def reopen_after_finish(self) -> bool:
        """The job's last calls to the PS (after ``Finish``, before the model was saved) found a
        PS gone: the controller takes events again, and that PS's exit reopens training."""
        if not isinstance(self.outcome, Finish) or self.command != "train":
            return False  # evaluate and predict only read the model: nothing to train again
        self.outcome = None
        return True

    def _on_ps_silent(self, indices: tuple[int, ...]) -> list[Decision]:
        now = self._clock()
        self._ps_silent_since = {i: self._ps_silent_since.get(i, now) for i in indices}
        decisions: list[Decision] = []
        for index, since in sorted(self._ps_silent_since.items()):
            if now - since >= PS_SILENT_SECONDS and index not in self._ps_replaced:
                self._ps_replaced.add(index)
                reason = f"it answered no probe for {now - since:.0f} s (frozen or hung)"
                logger.warning("parameter server %d makes no progress: %s; killing it", index, reason)
                decisions.append(ReplacePS(index, reason))
        return decisions

    def _on_ps_exit(self, exit_: ProcessExit) -> list[Decision]:
        self._ps_replaced.discard(exit_.index)
        self._ps_silent_since.pop(exit_.index, None)
        if self.command != "train":
            # Evaluate and predict read the model only: once their tasks are done it is not needed.
            return [] if self.dispatcher.finished else [Fail(describe_exit(exit_, "died"))]
        reopened: list[Decision] = []
        if self.dispatcher.finished:
            if not self.saves_checkpoints and (self.replicas is None or not self.replicas.survives(exit_.index)):
                return [Fail(shard_lost(exit_))]
            if self.replicas is not None and exit_.index in self.replicas.primary:  # a promotion, then the relaunch
                self._promoting_after_finish[exit_.index] = exit_
            reopened = self._reopen(exit_)
        self.ps_relaunches += 1
        if self.ps_relaunches > self.max_ps_relaunches:
            return [Fail(describe_exit(exit_, "died"))]
        self._live_workers_told = -1  # the new PS knows nothing yet
        self.leveling.ps_relaunched()
        relaunch = [RelaunchPS(exit_)] if self.replicas is None else self.replicas.ps_exited(exit_, self._clock())
        return reopened + relaunch + (self.rounds.ps_died() if self.rounds is not None else [])

    def _on_replica_answer(self, event) -> list[Decision]:
        """--ps_replicas: the answer to a promotion or a catch-up. After the last task, the job
        stays reopened until the relaunch decided now is carried out: a fallback rewinds the
        ledger only then, and the job must not end first (the simulator's seed 433: it ended its
        workers, then failed with "every worker exited"). A promotion that failed there without
        a checkpoint would refill the shard with an untrained copy: the job fails as without
        replicas."""
        exit_ = self._promoting_after_finish.pop(getattr(event, "dead", -1), None)
        if exit_ is not None:
            if isinstance(event, PromotionFailed) and not self.saves_checkpoints:
                return [Fail(shard_lost(exit_, f"its shard's backup could not take over ({event.reason})"))]
            self._reopening = True
        return self.replicas.answered(event, self._clock())

    def _reopen(self, exit_: ProcessExit) -> list[Decision]:
        """Training had ended, the model is not saved yet: the workers get tasks again, not END,
        and those that left start again."""
        logger.warning("%s after the last task, before the model was saved: the job goes on until the "
                       "model is saved whole (the workers that left start again)", describe_exit(exit_, "died"))
        self.dispatcher.reopen()
        self._done_since = None
        self._reopening = True  # until the recovery is carried out: the ledger may go back
        return self._carry(self.instances.reopen())
