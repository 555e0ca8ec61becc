"""How a job comes back from a PS death or a master restart: checkpoint cuts and data positions.

A part of the job's executor (``Job`` in elasticdl/master/job.py), in its own module. What to do
is decided by the recovery policy (elasticdl/master/recovery_policy.py, pure); this module gathers
its facts (the cuts on disk) and carries its plans out. A dead PS is relaunched from the latest
verified cut and the survivors roll back to it, or, with checkpoints kept but none usable, every
PS starts over from version 0; hand-outs are fenced on the PS, and the ledger goes back to the
cut's data position (or the start), so that every record's update is in the model exactly once.
A resumed master does the same from the ledger in etcd.
"""

from __future__ import annotations

import logging

import grpc

from elasticdl.master import controller as c
from elasticdl.master import recovery_policy as policy
from elasticdl.master.cut_recovery import (
    cuts_found,
    discard_abandoned,
    latest_cut,
    read_cut,
    rewind_ledger,
    skipped_bad_records,
)
from elasticdl.master.report import JobReport
from elasticdl.model import checkpoint

logger = logging.getLogger(__name__)


class Recovery:
    """The job's PS relaunches, rollbacks and resume (a part of ``Job``)."""

    def _restore_latest_checkpoint(self) -> None:
        """A resumed job: the PS come back from the latest cut; the ledger goes back to its data
        position once they serve (``_rewind_to_restored_cut``)."""
        cut = latest_cut(self.config.checkpoints.checkpoint_dir, self.state.term_floor)  # this lineage's
        if cut is not None:
            self._resume_cut = cut.path
            logger.info("the parameter servers restore the latest checkpoint, %s", self._resume_cut)

    def _rewind_to_restored_cut(self) -> None:
        """A resumed ledger says which records were done; the model holds those of the cut the PS
        restored. As the recovery policy plans it (``plan_resume``): the records after the cut's
        data position are trained again; with checkpoints kept but none usable, every record
        from the start; without checkpoints, the done ones are counted possibly missing."""
        cut = read_cut(self._resume_cut) if self._resume_cut else None
        skipped = skipped_bad_records(self.dispatcher.bad_records(), self.checked.files)
        facts = policy.ResumeFacts(
            self._ps.num_ps, bool(self.config.checkpoints.checkpoint_dir),
            None if cut is None else policy.CutFound(cut.path, cut.version, True, cut.marks, tuple(cut.records_applied)))
        match policy.plan_resume(facts):
            case policy.RestoreCut() as plan:
                rewound = rewind_ledger(self.main_tasks, plan.marks, plan.held, plan.cut.path, "master restart", skipped)
                self.records_possibly_missing += rewound.possibly_missing
                logger.warning("resumed at the checkpoint of version %d: %d records after its data position are "
                               "trained again", plan.version, rewound.retrained)
            case policy.StartOver() as plan:
                # The PS are new and empty; no file of the abandoned timeline may make a cut with theirs.
                discard_abandoned(self.config.checkpoints.checkpoint_dir, plan.version, plan.restart,
                                  self.state.term, self.state.term_floor)
                rewound = rewind_ledger(self.main_tasks, plan.marks, plan.held, "the model started over",
                                        "master restart", skipped)
                self.records_possibly_missing += rewound.possibly_missing
                logger.warning("resumed without a usable checkpoint in --checkpoint_dir (none written yet, or damaged "
                               "or partial): the parameter servers start from the initial model, and the job trains "
                               "every record again from the start (%d records)", rewound.retrained)
            case policy.KeepLedger():
                self.records_possibly_missing = sum(e.records_done for e in self.main_tasks.epochs)
                logger.warning("resumed without --checkpoint_dir: the parameter servers start from the initial "
                               "model, so the %d records the ledger counts as done are not in it. Give the job "
                               "--checkpoint_dir to resume without losing them.", self.records_possibly_missing)

    def _note_restore(self, report: JobReport) -> None:
        """Name the checkpoint the PS start from (they resolve the same directory the same way)."""

        init = self._resume_cut or self.config.checkpoints.checkpoint_dir_for_init
        if not init:
            return
        try:
            report.restored_from = checkpoint.resolve_checkpoint(init)
        except checkpoint.CheckpointError as err:  # the PS say so too, and the job fails on their exit
            logger.warning("%s", err)
            report.restored_from = init
            return
        if self.command != "train":
            report.checkpoint = report.restored_from  # the model evaluate and predict ran
        version = checkpoint.version_of(report.restored_from)
        self.progress.model_version = version
        logger.info("the parameter servers start from checkpoint %s (model version %d)", report.restored_from, version)

    def _relaunch_ps(self, exit_) -> c.PSRelaunched:
        """A dead PS comes back on the same address, as the recovery policy plans it
        (elasticdl/master/recovery_policy.py): from the newest verified cut, the survivors rolled
        back to it; every PS started over when checkpoints are kept but none is usable; or, without
        checkpoints, empty and refilled from a worker's copy. This method only gathers the facts
        and carries the plan out."""
        cfg = self.config
        facts = policy.PSLossFacts(
            dead=exit_.index, num_ps=self._ps.num_ps, checkpoint_dir=bool(cfg.checkpoints.checkpoint_dir),
            trains=self.main_tasks is not None,
            cuts=cuts_found(cfg.checkpoints.checkpoint_dir, self.state.term_floor),  # this lineage's
            missing_without_cut=self._missing_without_cut(),
        )
        match policy.plan_ps_loss(facts):
            case policy.RefillEmpty(missing=missing):
                logger.error(
                    "%s; relaunching it on port %s empty: the workers give it their copy of its variables. "
                    "Without a checkpoint (--checkpoint_dir, --checkpoint_steps) the updates of up to %d records "
                    "since the workers' last pull are missing from its shard, and its optimizer slots start over",
                    c.describe_exit(exit_, "died"), self._ps_port(exit_.index), missing,
                )
                self._start_ps(exit_.index)
                return c.PSRelaunched(exit_.index, None, missing=missing)
            case policy.RestoreCut() as plan:
                return self._restore_cut(exit_, plan)
            case policy.StartOver() as plan:
                return self._start_over(exit_, plan)

    def _missing_without_cut(self) -> int:
        """The records whose updates a PS refilled empty from a worker's copy may lack, at most."""
        cfg = self.config
        return policy.records_between_pulls(
            cfg.consistency.get_model_steps, cfg.consistency.push_steps, cfg.consistency.overlap_communication,
            cfg.training.minibatch_size, len(self.controller.workers))

    def _ps_port(self, index: int) -> str:
        return self.ps_addresses[index].rsplit(":", 1)[1]

    def _start_ps(self, index: int, *extra: str) -> None:
        """Start PS ``index`` again on its address."""
        self.backend.start("ps", index, [*self._ps_args[index], "--port", self._ps_port(index), *extra])

    def _restore_cut(self, exit_, plan: policy.RestoreCut) -> c.PSRelaunched:
        """The whole job goes back to the cut: the dead PS restores it, the survivors roll back to
        it, every hand-out made so far is fenced, and the ledger returns to the cut's data position,
        so every record's update is in the model exactly once."""
        fence = self.main_tasks.fence_all()
        logger.error("%s; relaunching it on port %s from the checkpoint %s; every PS goes back to version %d",
                     c.describe_exit(exit_, "died"), self._ps_port(exit_.index), plan.cut.path, plan.version)
        self._start_ps(exit_.index, "--restore_from", plan.cut.path, "--fence", str(fence))
        failed = self._ps.restore_each(plan.cut.path, fence, only=list(plan.survivors))
        for survivor, err in sorted(failed.items()):
            # Dead too, or not serving yet (a spare relaunched after a promotion, its shards
            # routed elsewhere): it must not go on from what it held, so it starts again from
            # the cut. Left alone, a spare answered "moved" forever (a random-delay kill run).
            logger.error("PS %d could not go back to %s (%s): it starts again from the cut", survivor,
                         plan.cut.path, err.details())
            self.backend.stop("ps", survivor)  # its exit, if any, is no death: replaced below
            self._start_ps(survivor, "--restore_from", plan.cut.path, "--fence", str(fence))
            self._restarted.add(("ps", survivor))
        return self._rewind(exit_.index, plan, plan.cut.path, "rollback")

    def _start_over(self, exit_, plan: policy.StartOver) -> c.PSRelaunched:
        """No usable cut although checkpoints are kept: every PS starts again empty at version 0
        and the ledger goes back to the start, so that each shard's own count, and the model's
        versions, hold every record once (a lone refill would start one shard's count over while
        the ledger kept going). The abandoned timeline's files go, so that none of them ever makes
        a cut with the new timeline's."""
        fence = self.main_tasks.fence_all()
        logger.error(
            "%s, and no checkpoint of this job verifies (none written yet, or damaged or partial): every "
            "parameter server starts again from version 0 and the job trains every record again from the "
            "start (the workers give the servers their copy of the model)", c.describe_exit(exit_, "died"))
        for index in plan.restart:
            if index != exit_.index:
                self.backend.stop("ps", index)  # a planned stop: started again below, its exit not a death
        discard_abandoned(self.config.checkpoints.checkpoint_dir, plan.version, plan.restart, self.state.term,
                          self.state.term_floor)
        for index in plan.restart:
            self._start_ps(index, "--fence", str(fence))
            if index != exit_.index:
                self._restarted.add(("ps", index))
        return self._rewind(exit_.index, plan, "the model started over", "start over")

    def _rewind(self, index: int, plan, where: str, cause: str) -> c.PSRelaunched:
        rewound = rewind_ledger(self.main_tasks, plan.marks, plan.held, where, cause,
                                skipped_bad_records(self.dispatcher.bad_records(), self.checked.files))
        return c.PSRelaunched(index, plan.version, retrained=rewound.retrained, missing=rewound.possibly_missing)

    def _fence(self, handouts: list[int], task_ids: list[int]) -> dict[int, int] | None:
        """Fence task hand-outs on every PS; each task's lowest applied mark (None: a PS is away)."""
        try:
            per_ps = self._ps.fence(handouts, task_ids)
        except grpc.RpcError as err:
            logger.warning("could not ask the parameter servers how far tasks %s were applied (%s): their "
                           "records are trained again", task_ids, err.details())
            return None
        return {t: min(marks.get(t, 0) for marks in per_ps) for t in task_ids}

    def _arm_epoch_cut(self, stats: list) -> None:
        """Every PS saves at the same next version: a cut near the epoch boundary, so a rollback
        never has to go back further than about an epoch."""
        at = max(s.version for s in stats) + 1
        try:
            self._ps.save_checkpoint(at_version=at)
        except grpc.RpcError as err:  # a PS is past it already (async) or away: the next cut serves
            logger.info("no checkpoint at the epoch's end (version %d): %s", at, err.details())
