"""How a job ends: the final checkpoint, callbacks and export, the checks of what the PS
applied, stopping the roles, and the report, written whatever happened.

A part of the job's executor (``Job`` in elasticdl/master/job.py), in its own module.
"""

from __future__ import annotations

import logging
import os
import time

import grpc

from elasticdl.data.sources import make_shards
from elasticdl.errors import JobFailedError
from elasticdl.master import controller as c
from elasticdl.master import embedding_stats
from elasticdl.master.continuation import continue_command, last_complete_checkpoint
from elasticdl.master.cut_recovery import skipped_bad_records
from elasticdl.master.report import JobReport
from elasticdl.master.stream_export import capture_ledger
from elasticdl.master.telemetry import summarize

logger = logging.getLogger(__name__)

# After Ctrl-C, how long each kind of role (spares, workers, PS) gets to leave before SIGKILL:
# the whole stop stays within the 2 s the user is promised (docs/getting_started.md).
INTERRUPT_GRACE_SECS = 0.4
# A call to a PS failed: how long the job looks for the PS's exit before it takes the failure as
# the PS's answer (a PS killed shows its exit within milliseconds of its reaping).
PS_EXIT_SHOWS_SECS = 2.0


class JobEnd:
    """The end of a job (a part of ``Job``)."""

    def _stop_everything(self, succeeded: bool, interrupted: bool = False) -> None:
        """``interrupted`` (Ctrl-C): the roles get INTERRUPT_GRACE_SECS to leave, not the usual
        10 s: nothing they would finish is kept, and the user waits."""
        self.progress.close()  # the live line stops where it is, also on a failure
        if interrupted:
            self.backend.stop_all(timeout=INTERRUPT_GRACE_SECS)
        else:
            self.backend.stop_all()
        if self._ps is not None:
            self._ps.close()
        if self._server is not None:
            self._server.stop(grace=1)
            self._remove_master_addr()
        if self.tensorboard is not None:
            self.tensorboard.close()
        job_done = succeeded and self.dispatcher.finished and self.dispatcher.main_finished
        self.state.close(self.main_tasks, job_done)

    def _remove_master_addr(self) -> None:
        """The master no longer serves: `elasticdl scale` then says the job ended, at once."""
        path = os.path.join(self.config.job.run_dir, "master.addr")
        try:
            with open(path) as f:
                mine = f.read().strip() == self.master_address
            if mine:  # a later run of the same job name may have written its own
                os.remove(path)
        except OSError:
            pass

    def _complete_report(self, report: JobReport, started: float) -> None:
        """Fill in the report and write report.json. On a failed job nothing here may hide its
        error: a problem is logged instead."""
        cfg = self.config
        try:
            report.seconds = round(time.monotonic() - started, 2)
            report.model_version = max(report.model_version, self.model_version)
            report.add_tasks(self.main_tasks, self.progress)
            if self.controller is not None:
                report.stopped_early = self.controller.stop_reason
                report.phases = [str(p) for p in self.controller.phases]
                report.add_instances(self.instances, self.controller.ps_relaunches, self.controller.replaced)
                report.ps_rollbacks = [r.to_dict() for r in self.controller.rollbacks]
                if self.controller.replicas is not None:
                    report.ps_failovers = [r.to_dict() for r in self.controller.replicas.records]
                report.records_possibly_missing = self.records_possibly_missing + sum(
                    r.records_possibly_missing for r in self.controller.rollbacks)
            report.state_store = "etcd" if cfg.elasticity.etcd_endpoints else "memory"
            report.resumed = self.state.resumed
            if self.state.in_etcd:
                report.add_outages(self.state.outages)
            report.add_evaluations(self.evaluation)
            report.add_faults(self.dispatcher, cfg.data.max_bad_records)
            report.checkpoint_failures = self._checkpoint_failures.total
            report.checkpoint_errors = list(self._checkpoint_failures.errors)
            if report.status == "interrupted" and self.command == "train":
                self._note_continuation(report)
        except Exception:
            if report.status == "succeeded":
                raise
            logger.exception("the report of the failed job is incomplete")
        path = os.path.abspath(os.path.join(cfg.job.run_dir, "report.json"))
        try:
            report.report_file = path
            report.write(path)
        except OSError as err:
            report.report_file = ""
            logger.error("could not write the job's report to %s: %s", path, err)
            return
        if report.status != "succeeded":
            logger.error("the job %s at %s: %s; report: %s", report.status, report.failed_step, report.error, path)

    def _note_continuation(self, report: JobReport) -> None:
        """Ctrl-C: the last complete checkpoint, and the command that continues from it."""
        report.checkpoint = last_complete_checkpoint(self.config.checkpoints.checkpoint_dir)
        if report.checkpoint and self.main_tasks is not None:
            done = sum(1 for e in self.main_tasks.epochs if e.records_done >= e.records_total)
            report.continue_command = continue_command(self.config, report.checkpoint, done)

    def _check_exactly_once(self, stats: list) -> dict:
        """The model-side truth: each PS counted the records whose gradients it applied; they must
        be the records the ledger counts as done (bad records skipped in a batch were pushed with it)."""
        skipped = skipped_bad_records(self.dispatcher.bad_records(), self.checked.files)
        done = sum(e.records_done for e in self.main_tasks.epochs) + skipped
        applied = [s.records_applied for s in stats]
        holds = all(a == done for a in applied)
        if holds:
            logger.info("exactly once: every PS applied the gradients of the %d records trained", done)
        else:
            logger.warning("the parameter servers applied the gradients of %s records, the ledger counts %d done "
                           "(batches skipped for NaN/Inf or staleness, or updates lost without a checkpoint)",
                           applied, done)
        return {"records_applied": applied, "records_done": done, "holds": holds}

    def _epoch_logs(self) -> dict[str, float]:
        loss_sum, batches = self.progress.loss_sum, self.progress.batches
        mark_sum, mark_batches = self._epoch_loss_mark
        self._epoch_loss_mark = (loss_sum, batches)
        n = batches - mark_batches
        return {"loss": (loss_sum - mark_sum) / n} if n else {}

    def _epoch_telemetry(self, stats: list, epoch: int | None = None) -> dict:
        """Log the staleness summary since the last epoch's (or of the whole job, without an epoch)."""
        total = summarize(stats, self.clocks.blocked_seconds)
        embedding_stats.report(stats, self.tensorboard, epoch)
        if epoch is not None:
            since = total.minus(self._telemetry_mark)
            # One line per epoch only when something happened; the rest is in the job's line.
            level = logging.INFO if since.noteworthy else logging.DEBUG
            logger.log(level, "epoch %d consistency: %s", epoch + 1, since.describe(self.config.consistency.stale_remedy))
            self._telemetry_mark = total
        else:
            logger.info("job consistency (%s): %s", self.config.consistency.description,
                        total.describe(self.config.consistency.stale_remedy))
        return total.to_dict()

    def _despite_ps_losses(self, call) -> None:
        """``call()``: the job's last calls to the PS, once the loop ended. If one found a PS
        gone, that PS died after the last task but before the model was saved: the job goes on
        as it would have had the PS died earlier (the controller reopens it: recovered, what was
        rolled back trained again), then calls again."""
        while True:
            try:
                return call()
            except (grpc.RpcError, JobFailedError) as err:
                failed = err if isinstance(err, grpc.RpcError) else err.__cause__
                if not isinstance(failed, grpc.RpcError) or failed.code() != grpc.StatusCode.UNAVAILABLE:
                    raise  # a PS that answered (a full disk, say), not one gone
                exits = self._exits_after_a_failed_call()
                if not any(e.role == "ps" for e in exits) or not self.controller.reopen_after_finish():
                    raise
            for exit_ in exits:
                self._feed(c.RoleExited(exit_))
            self.requests.reopen()
            self._loop()

    def _exits_after_a_failed_call(self) -> list:
        """The roles that exited, waiting up to PS_EXIT_SHOWS_SECS for a PS among them: a call
        fails the moment a PS is killed, its exit shows once the OS has reaped it."""
        deadline = time.monotonic() + PS_EXIT_SHOWS_SECS
        exits = []
        while True:
            exits += self.backend.poll_exits()
            if any(e.role == "ps" for e in exits) or time.monotonic() >= deadline:
                return exits
            time.sleep(0.05)

    def _take_the_model(self, report: JobReport) -> None:
        """What the job reads from the PS at its end: their counts (exactly once, staleness),
        the model (for callbacks and export) and, training, the final checkpoint."""
        cfg = self.config
        if self.command == "train":
            self._step = "final stats"
            stats = self._ps_stats()
            report.staleness = self._epoch_telemetry(stats)
            report.note_refusals()  # the gradient guard's (ps/gradient_guard.py)
            report.embedding_tables = embedding_stats.summarize_tables(stats)
            report.exactly_once = self._check_exactly_once(stats)
            if self.stream is not None:
                report.stream = self.stream.summary(self.main_tasks)
        self._step = "final model pull"
        report.model_version = max(self._sync_model(), self.model_version)
        if self.command == "train" and cfg.checkpoints.checkpoint_dir:
            self._step = "final checkpoint"
            logger.info("writing the final checkpoint of version %d to %s", report.model_version,
                        cfg.checkpoints.checkpoint_dir)  # said first: a big model takes seconds
            try:
                report.checkpoint = self._ps.save_checkpoint()[0]
            except grpc.RpcError as err:
                raise JobFailedError(
                    f"the final checkpoint in --checkpoint_dir {cfg.checkpoints.checkpoint_dir} failed: "
                    f"{err.details()}"
                ) from err  # its code tells a PS gone (UNAVAILABLE: see _despite_ps_losses)
            logger.info("final checkpoint: %s", report.checkpoint)

    def _finish(self, report: JobReport) -> None:
        """Callbacks, export, prediction outputs (the model was taken from the PS before)."""
        from elasticdl.model.export import export_saved_model

        cfg = self.config
        if self.command == "train":
            self._step = "on_train_end"
            self.callbacks.on_train_end({"model_version": report.model_version})
            if cfg.outputs.output:
                self._step = "export"
                try:
                    if self.exports is not None:  # --export_every_secs: OUTPUT/<version>/ as the others
                        report.saved_model = self.exports.final(self._serving_model(), report.model_version,
                                                                capture_ledger(self.main_tasks))
                    else:
                        report.saved_model = export_saved_model(self._serving_model(), cfg.outputs.output)
                except OSError as err:
                    raise JobFailedError(
                        f"exporting the SavedModel to --output {cfg.outputs.output} failed: {err}"
                    ) from err
        if self.command == "predict" and self.checked.spec.prediction_outputs_processor is None:
            from elasticdl.model.prediction import join_parts

            self._step = "prediction join"
            shards = make_shards(self.checked.files, cfg.effective_records_per_task)
            try:
                report.predictions = join_parts(cfg.outputs.prediction_outputs, shards)
            except OSError as err:
                raise JobFailedError(
                    f"joining the predictions in --prediction_outputs {cfg.outputs.prediction_outputs} "
                    f"failed: {err}"
                ) from err
            logger.info("predictions: %s", report.predictions)
        self._step = "done"
        if self.evaluation is not None and self.evaluation.results:
            last = self.evaluation.results[-1]
            logger.info(
                "metrics of version %d: %s", last.model_version,
                ", ".join(f"{k}={v:.4f}" for k, v in last.metrics.items()),
            )
