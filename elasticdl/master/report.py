"""The job's report: what ``elasticdl train|evaluate|predict`` prints and writes to report.json.

The master writes report.json whatever the outcome: a job that failed (also at its end: the
final checkpoint, the export, the prediction join) has ``status`` "failed", the step that
failed and the error, and still raises that error (its exit code is in ``exit_code``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field

from elasticdl.errors import exit_status
from elasticdl.master.evaluation_service import EvaluationService, TaskDispatcher
from elasticdl.master.instance_manager import InstanceManager
from elasticdl.master.progress import TrainingProgress
from elasticdl.master.task_manager import TaskManager

logger = logging.getLogger(__name__)


@dataclass
class JobReport:
    job_name: str
    command: str = "train"
    status: str = "succeeded"  # or "failed", "interrupted"
    failed_step: str = ""  # where a failed job stopped: start, training, final checkpoint, export, ...
    error: str = ""  # the error that ended it, as the command prints it
    exit_code: int = 0
    seconds: float = 0.0
    epochs: int = 0
    records_trained: int = 0
    model_version: int = 0
    final_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    evaluations: list[dict] = field(default_factory=list)
    saved_model: str = ""
    checkpoint: str = ""
    # Interrupted (Ctrl-C): the command that continues from `checkpoint` (elasticdl/master/continuation.py).
    continue_command: str = ""
    predictions: str = ""
    log_dir: str = ""
    report_file: str = ""
    tensorboard_log_dir: str = ""
    dropped_tasks: int = 0
    # Each task dropped after --max_task_retries: {task_id, type, path, start, end, epoch, tries, error}.
    dropped: list[dict] = field(default_factory=list)
    # Each bad record found (skipped, up to --max_bad_records): {path, index, reason}.
    bad_records: list[dict] = field(default_factory=list)
    max_bad_records: int = 0
    stopped_early: str = ""
    # Elasticity: per epoch, records trained more than once (from tasks whose worker was
    # killed or failed mid-task; a graceful preemption adds none).
    records_trained_twice: list[int] = field(default_factory=list)
    records_done_per_epoch: list[int] = field(default_factory=list)  # each epoch's distinct records
    records_per_epoch: int = 0
    # Task attempts that did not complete and went back to the queue, every cause, and by cause
    # ("worker left", "worker died", "task failed", "timeout", "rollback", "master restart").
    tasks_interrupted: int = 0
    tasks_requeued: dict[str, int] = field(default_factory=dict)
    worker_relaunches: int = 0
    worker_preemptions: int = 0
    ps_relaunches: int = 0
    # Workers killed for making no progress (a task timed out, or still there after the end).
    workers_replaced: list = field(default_factory=list)
    phases: list = field(default_factory=list)  # the controller's phases, in order (the last: where it ended)
    # Each PS that came back older than the model it held: its updates after to_version are
    # lost (to_version None: it restarted empty and took a worker's copy of its variables).
    ps_rollbacks: list[dict] = field(default_factory=list)
    # --ps_replicas: each shard whose primary's PS died and whose backup took over (shard, old and
    # new primary, pause in seconds, version): nothing rolled back (docs/replicas.md).
    ps_failovers: list[dict] = field(default_factory=list)
    # Per epoch, records trained again by cause ("rollback", "master restart", "worker died",
    # "task failed", "timeout"): updates that were lost and trained again, never applied twice.
    records_retrained: list[dict] = field(default_factory=list)
    # Records whose updates may be missing from the model: without --checkpoint_dir (a PS restarted
    # empty, a master resumed), or after a rollback to a cut older than the last epoch's start
    # (checkpoint writes had failed): the ledger counted them done, the cut does not hold them
    # (elasticdl/master/cut_recovery.py).
    records_possibly_missing: int = 0
    # The check made at the end: every PS applied the gradients of exactly the records the ledger
    # counts as done (ps/data_position.py). {"records_applied": [per PS], "records_done": n, "holds": bool}
    exactly_once: dict = field(default_factory=dict)
    # A stream job (--training_data kafka://...): how it closed and, per partition, the offsets it
    # started at, cut to, and saw (elasticdl/master/stream_source.py); {} for files.
    stream: dict = field(default_factory=dict)
    # --window_records: progressive validation, each window of records scored before they were
    # trained: {index, first_record, records, tasks, model_version, metrics} (master/progressive.py).
    progressive: list[dict] = field(default_factory=list)
    # --export_every_secs: every export (version, path, records, newest offsets, freshness) and the
    # median and largest freshness (master/stream_export.py); {} without the flag.
    exports: dict = field(default_factory=dict)
    state_store: str = "memory"
    resumed: bool = False  # continued a ledger a previous master left in etcd
    # The checkpoint the parameter servers started from (--checkpoint_dir_for_init, or the
    # latest in --checkpoint_dir when a resumed job restores it); "" when they started fresh.
    restored_from: str = ""
    etcd_outages: list[dict] = field(default_factory=list)
    consistency: str = ""
    staleness: dict = field(default_factory=dict)
    # PS checkpoint writes that failed during the job (training went on; the next one retried).
    checkpoint_failures: int = 0
    checkpoint_errors: list[str] = field(default_factory=list)  # distinct messages, the first few
    # Gradients the PS' gradient guard refused (never applied): beyond float32, or far beyond the
    # running norm (--max_gradient_norm_ratio). A model that stopped improving may be why.
    gradients_refused: int = 0
    # Per embedding table, summed over the PS: rows, bytes, admissions, dropped_gradients,
    # evictions_ttl, evictions_max_rows (elasticdl/master/embedding_stats.py).
    embedding_tables: dict = field(default_factory=dict)

    def note_refusals(self) -> None:
        """Name the gradient guard's refusals (from ``staleness``), with a warning when there are any."""
        self.gradients_refused = int(self.staleness.get("gradients_refused", 0))
        if self.gradients_refused:
            logger.warning(
                "the parameter servers refused %d gradients as far beyond the running norm or beyond float32 "
                "(never applied; the PS logs say which): if the model stopped improving, this may be why. "
                "Look for exploding gradients (a lower learning rate, clipping) or a rogue caller; "
                "--max_gradient_norm_ratio sets the bound (0: no ratio check)", self.gradients_refused)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def failed(self, step: str, err: BaseException) -> None:
        """The job stopped at ``step`` with ``err`` (which the job raises after writing this)."""
        self.exit_code, message = exit_status(err)
        self.status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        self.failed_step = step
        self.error = message

    def write(self, path: str) -> None:
        """Write the report to ``path`` atomically (a temp file, then rename)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def add_tasks(self, tasks: TaskManager | None, progress: TrainingProgress) -> None:
        """Epochs, records and their repeats (training), dropped tasks (training and prediction)."""
        if tasks is None:
            return
        self.dropped_tasks = len(tasks.dropped_tasks())
        if self.command != "train":
            return
        self.epochs = tasks.epoch + 1
        self.records_trained = progress.records_trained
        self.final_loss = progress.recent_loss
        self.records_trained_twice = [e.records_trained_twice for e in tasks.epochs]
        self.records_retrained = [dict(e.retrained) for e in tasks.epochs]
        self.records_done_per_epoch = [e.records_done for e in tasks.epochs]
        self.records_per_epoch = tasks.records_per_epoch
        self.tasks_interrupted = sum(e.tasks_interrupted for e in tasks.epochs)
        for epoch in tasks.epochs:
            for cause, n in epoch.requeues.items():
                self.tasks_requeued[cause] = self.tasks_requeued.get(cause, 0) + n


    def add_faults(self, dispatcher: TaskDispatcher, max_bad_records: int) -> None:
        """The dropped tasks with their last error, and every bad record with its reason."""
        self.dropped = [
            {"task_id": t.task_id, "type": str(t.type), "path": t.shard.path, "start": t.shard.start,
             "end": t.shard.end, "epoch": t.epoch, "tries": t.retries, "error": t.last_error}
            for t in dispatcher.dropped_tasks()
        ]
        self.bad_records = [r._asdict() for r in dispatcher.bad_records()]
        self.max_bad_records = max_bad_records

    def add_instances(self, instances: InstanceManager, ps_relaunches: int, replaced=()) -> None:
        self.workers_replaced = [{"worker": r.index, "reason": r.reason} for r in replaced]
        self.worker_relaunches = instances.relaunches
        self.worker_preemptions = instances.preemptions
        self.ps_relaunches = ps_relaunches

    def add_evaluations(self, evaluation: EvaluationService | None) -> None:
        if evaluation is None:
            return
        self.evaluations = [
            {"model_version": r.model_version, "reason": r.reason, "records": r.records, "metrics": r.metrics}
            for r in evaluation.results
        ]
        if evaluation.results:
            self.metrics = evaluation.results[-1].metrics

    def add_outages(self, outages: list) -> None:
        self.etcd_outages = [
            {"seconds": round(o.seconds, 2), "error": o.error, "snapshots_kept": o.snapshots_kept,
             "ongoing": o.ongoing} for o in outages
        ]


MAX_CHECKPOINT_ERRORS = 5


class CheckpointFailures:
    """Checkpoint write failures the PS count (in their stats), noticed by the master.

    A PS counts its failures from its start; a relaunched PS counts from 0 again.
    """

    def __init__(self):
        self._seen: dict[int, int] = {}  # PS index -> its count at the last look
        self.total = 0
        self.errors: list[str] = []

    def note(self, stats: list) -> list[str]:
        """The messages of failures new since the last look, one per PS that had some."""
        new = []
        for ps, s in enumerate(stats):
            count = s.checkpoint_failures
            last = self._seen.get(ps, 0)
            fresh = count - last if count >= last else count  # fewer: the PS was relaunched
            self._seen[ps] = count
            if fresh > 0:
                self.total += fresh
                new.append(f"PS {ps}: {s.checkpoint_error}")
                if s.checkpoint_error not in self.errors and len(self.errors) < MAX_CHECKPOINT_ERRORS:
                    self.errors.append(s.checkpoint_error)
        return new
