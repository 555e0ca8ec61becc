"""The worker's task loop: get a task, train its records batch by batch, report it."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from elasticdl import fs
from elasticdl.data.columns import ColumnStream, select
from elasticdl.data.errors import BadRecord, BadRecordError
from elasticdl.data.sources import load_records, record_format, remember_file_footer
from elasticdl.data.task_prefetch import TaskPrefetch
from elasticdl.errors import ElasticDLError, TrainingDivergedError
from elasticdl.mode import Mode
from elasticdl.model.records import example_check, find_bad_records
from elasticdl.model.sample_weight import features_of, unpack
from elasticdl.model.spec import DatasetMetadata, ModelSpec
from elasticdl.model.trainer import Trainer
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.master_client import MasterClient, TaskOrder
from elasticdl.rpc.ps_client import PSClient
from elasticdl.worker.accumulation import GradientAccumulator
from elasticdl.worker.batch_loop import (
    MAX_NONFINITE_BATCHES,
    PS_RECONNECT_SECONDS,
    SYNC_WAIT_SECONDS,
    BatchLoop,
)
from elasticdl.worker.consistency import ConsistencyPolicy, TaskTakenBackError
from elasticdl.worker.overlap import Exchange
from elasticdl.worker.progressive import ProgressiveScore
from elasticdl.worker.startup import StartupClock
from elasticdl.worker.task_data import BatchStream

# The limits live with the batch loop; named here too, where tests and the PS's servicer look.
__all__ = ["MAX_NONFINITE_BATCHES", "PS_RECONNECT_SECONDS", "SYNC_WAIT_SECONDS", "TaskResult", "Worker"]

logger = logging.getLogger(__name__)



@dataclass
class TaskResult:
    records: int = 0
    loss_sum: float = 0.0
    batches: int = 0
    metric_states: dict | None = None
    interrupted: bool = False  # left before the end: `records` is the trained prefix


class Worker(BatchLoop):
    """Gets tasks, reads their records, trains (worker/batch_loop.py), evaluates or predicts, reports."""

    def __init__(
        self,
        worker_id: int,
        spec: ModelSpec,
        trainer: Trainer,
        master: MasterClient,
        ps: PSClient,
        minibatch_size: int,
        has_header: bool = False,
        columns: list[str] | None = None,
        records: str = "examples",
        wait_seconds: float = 0.5,
        consistency: ConsistencyPolicy | None = None,
        prediction_outputs: str = "",
        may_initialize_ps: bool = True,
        max_bad_records: int = 0,
        startup: StartupClock | None = None,
        progressive: ProgressiveScore | None = None,
    ):
        self.worker_id = worker_id
        self.spec = spec
        self.trainer = trainer
        self.trainer.connect(ps)  # embedding rows come from the parameter servers
        self.master = master
        self.ps = ps
        self.minibatch_size = minibatch_size
        self.has_header = has_header
        self.columns = columns  # Parquet projection
        self.records = records  # "columns": a Parquet task reaches dataset_fn as column tensors
        self.wait_seconds = wait_seconds
        # When to pull, when to wait, what a push's answer means: sync, async or SSP.
        self.consistency = consistency or ConsistencyPolicy(num_ps=ps.num_ps)
        if self.consistency.num_ps != ps.num_ps:
            raise ValueError(
                f"the consistency policy is for {self.consistency.num_ps} parameter servers, "
                f"the worker has {ps.num_ps}"
            )
        self.prediction_outputs = prediction_outputs
        # Only a training job may give the PS a fresh model; evaluate/predict need a checkpoint.
        self.may_initialize_ps = may_initialize_ps
        self._processor = None  # the model zoo's PredictionOutputsProcessor, made on first use
        self._streams: dict[tuple[Mode, DatasetMetadata], BatchStream] = {}
        self.stop_requested = False
        self._task_progress = 0  # records of the current training task trained so far
        self.batches_trained = 0
        self.blocked_seconds = 0.0  # waited for the staleness bound (SSP)
        # Bad records (training and evaluation) are skipped while this worker has seen at most
        # this many; the master holds the job's count and fails the job past --max_bad_records.
        self.max_bad_records = max_bad_records
        self.bad_records: dict[tuple[str, int], BadRecord] = {}  # every one this worker found
        self._task_bad: list[BadRecord] = []  # found in the current task: sent with its report
        self._nonfinite_in_row = 0  # batches in a row whose loss or gradients were NaN/Inf
        self._batch_context = ""  # "task 3 (file records 0-255), batch 2": for messages
        self._batch_position: BatchPosition | None = None  # the batch being trained (pushes name it)
        # --push_steps: gradients applied locally, pushed every n batches and before a task is reported.
        self._accumulator = GradientAccumulator()
        self.pushes = 0  # pushes every PS accepted (fewer than batches_trained with --push_steps)
        # --overlap_communication: the push (and pull) of the last batch, running while this one computes.
        self._exchange: Exchange | None = None
        self._exchanges: ThreadPoolExecutor | None = None  # its one thread, made on first use
        # Sync: a training task's first pull, asked for while its records are read.
        self._prefetched_pull: Exchange | None = None
        self._startup = startup or StartupClock()
        self.progressive = progressive  # --window_records: each training batch scored before it is trained
        self._init_batch_loop()
        # The next task's records, read while this one trains (the master's read_ahead promise).
        self._task_reads = TaskPrefetch(self._load_records, dispose=_close_records)

    def run(self) -> None:
        try:
            self._run_tasks()
        finally:
            self._leave_task()  # nothing is left after a task; an error past the task loop may leave something
            if self._exchanges is not None:
                self._exchanges.shutdown(wait=False)
            for stream in self._streams.values():
                stream.close()  # its reader thread waits for the next task: let it go
            self._task_reads.close()

    def _run_tasks(self) -> None:
        handlers = {
            "training": self.train_task,
            "evaluation": self.evaluate_task,
            "prediction": self.predict_task,
        }
        while not self.stop_requested:
            order = self.master.get_task()
            self._startup.mark("tasks")
            if order.kind == "end":
                logger.info("no more tasks; %d batches trained; the records of %d of %d tasks were read ahead",
                            self.batches_trained, self._task_reads.taken_ahead, self._task_reads.taken)
                return
            if order.kind == "wait":
                time.sleep(self.wait_seconds)
                self._refill_while_waiting()
                continue
            for path, size, footer in order.footers:  # the master read them: no request for them
                remember_file_footer(path, size, footer)
            if order.read_ahead is not None and fs.is_remote(order.read_ahead[0]):
                # Read-ahead hides the network's latency; a local file is read when its task
                # comes, and its thread would only compete with the training for the GIL.
                self._task_reads.start(order.read_ahead)
            self._task_progress = 0
            self._task_bad = []
            self.consistency.task_started()
            try:
                result = handlers[order.kind](order)
            except TaskTakenBackError as err:  # the master gave it to another hand-out: nothing to report
                logger.info("task %d was taken back by the master (%s); taking the next one", order.task_id, err)
                continue
            except Exception as err:  # report it: the master retries the task, or fails the job
                if isinstance(err, (BadRecordError, TrainingDivergedError)):
                    logger.error("%s task %d failed: %s", order.kind, order.task_id, err)  # no traceback: data
                else:
                    logger.exception("%s task %d failed", order.kind, order.task_id)
                self.master.report(order.task_id, self._task_progress, f"{type(err).__name__}: {err}",
                                   bad_records=self._task_bad, diverged=isinstance(err, TrainingDivergedError),
                                   handout=order.handout)
                continue
            self.master.report(
                order.task_id, result.records, "", result.loss_sum, result.batches, self.model_version,
                result.metric_states, interrupted=result.interrupted, bad_records=self._task_bad,
                handout=order.handout,
            )
        logger.info("left the job as asked (preemption); %d batches trained", self.batches_trained)

    def request_stop(self) -> None:
        """SIGTERM: finish the current batch, report how far the task got, and leave."""
        self.stop_requested = True

    @property
    def model_version(self) -> int:
        return self.consistency.model_version

    @property
    def versions(self) -> list[int]:
        """The version held of each PS's shard."""
        return self.consistency.versions

    def _run_batches(self, order: TaskOrder, mode: Mode, step: Callable[[object, int], bool]) -> None:
        """Feed the task's records, batch by batch, to ``step(batch, records of the task done once
        it is trained)``, which returns False to leave the task early.

        A bad record (corrupt, or failing on its own in ``dataset_fn``, the model or the loss) is
        found, reported with the task, and skipped if ``--max_bad_records`` allows; else the task
        fails with BadRecordError. The batch that failed is looked for bad records by bisection
        (elasticdl/model/records.py); when none is to blame, the original error is raised.
        """
        records, corrupt = self._task_reads.take((order.path, order.start, order.end))
        skipped = {err.index for err in corrupt}
        positions = [i for i in range(order.start, order.end) if i not in skipped]  # index in the file
        if corrupt:
            self._found_bad(order, mode, [(err.index, err.problem + " (the file is corrupt)") for err in corrupt])
        total = order.end - order.start
        metadata = DatasetMetadata(record_format(order.path), getattr(records, "names", ()))
        stream = self._streams.get((mode, metadata))
        if stream is None:
            stream = self._streams[(mode, metadata)] = BatchStream(self.spec, mode, metadata, self.minibatch_size)
        while True:
            trained = 0  # records of `records` trained in this pass
            batches = stream.batches(records)
            try:
                for batch, done in batches:
                    if not step(batch, positions[done] - order.start if done < len(records) else total):
                        return
                    trained = done
                return
            except (grpc.RpcError, ElasticDLError, TaskTakenBackError):
                raise  # not the records' fault
            except Exception:
                chunk = records[trained:trained + self.minibatch_size]  # the batch that failed
                check = example_check(self.spec, mode, metadata, self._run_model)
                found = find_bad_records(chunk, check, passthrough=(grpc.RpcError, ElasticDLError))
                if not found:
                    raise
                self._found_bad(order, mode, [(positions[trained + i], reason) for i, reason in found])
                bad = {trained + i for i, _ in found}
                keep = [k for k in range(trained, len(records)) if k not in bad]
                records, positions = select(records, keep), [positions[k] for k in keep]
            finally:
                batches.close()  # a pipeline left mid-task is rebuilt for the next pass
                if isinstance(records, ColumnStream):
                    records.close()  # a task left early: the read-ahead thread stops

    def _load_records(self, task_range: tuple[str, int, int]):
        """(records, corrupt ones left out) of a task: see elasticdl/data/sources.py load_records."""
        path, start, end = task_range
        return load_records(path, start, end, self.records == "columns", self.has_header, self.columns,
                            batch_size=self.minibatch_size)

    def _found_bad(self, order: TaskOrder, mode: Mode, found: list[tuple[int, str]]) -> None:
        """Note bad records (index in the file, reason); raise BadRecordError unless they may be skipped."""
        new = [BadRecord(order.path, index, reason) for index, reason in found]
        self._task_bad += new
        for record in new:
            self.bad_records.setdefault((record.path, record.index), record)
        if mode == Mode.PREDICTION:  # a skipped record would shift every prediction after it
            raise BadRecordError(new, skippable=False)
        if len(self.bad_records) > self.max_bad_records:
            raise BadRecordError(list(self.bad_records.values()) if self.max_bad_records else new,
                                 self.max_bad_records)
        for record in new:
            logger.warning("skipped bad record %s (%d of --max_bad_records=%d)", record, len(self.bad_records),
                           self.max_bad_records)

    def _run_model(self, features):
        """The model on some features, built (and the PS initialized) first if it is not yet."""
        if not self.trainer.built:
            self.trainer.ensure_built(features)
            self._initialize_ps()
        return self.trainer.model(features, training=False)

    def _use_snapshot(self, order: TaskOrder, features) -> None:
        """Load the parameters an evaluation task must use (the next training batch re-pulls)."""
        if not self.trainer.built:
            self.trainer.ensure_built(features)
            self._initialize_ps()
        # Every PS's part in one call: a sliced variable is assigned once, whole (model/slicing.py).
        self.trainer.set_params({n: v for pulled in self.ps.pull_snapshot(order.snapshot_id)
                                 for n, v in pulled.params.items()})
        self.trainer.embeddings.snapshot_id = order.snapshot_id  # lookups read the same snapshot
        self.consistency.snapshot_loaded()  # the next training batch pulls first

    def _use_latest(self, features) -> None:
        if not self.trainer.built:
            self.trainer.ensure_built(features)
            self._initialize_ps()
        self._pull()

    def evaluate_task(self, order: TaskOrder) -> TaskResult:
        from elasticdl.model.metrics import MetricsAccumulator

        if self.spec.eval_metrics_fn is None:
            raise RuntimeError(f"{self.spec.module_path} defines no eval_metrics_fn()")
        metrics = MetricsAccumulator(self.spec.eval_metrics_fn())
        result = TaskResult()
        loaded = False

        def step(batch, _done: int) -> bool:
            nonlocal loaded
            features, labels, sample_weight = unpack(batch, self.spec, Mode.EVALUATION)
            if not loaded:
                self._use_snapshot(order, features)
                loaded = True
            metrics.update(labels, self.trainer.model(features, training=False), sample_weight)
            result.records += _batch_size(labels)
            return True

        try:
            self._run_batches(order, Mode.EVALUATION, step)
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise
            # A PS restarted and lost the snapshot: not this task's fault, so it goes back
            # whole without using up a retry; the master evaluates again on a new snapshot.
            logger.warning("evaluation task %d: the snapshot is gone (%s); handing it back", order.task_id,
                           err.details())
            time.sleep(self.wait_seconds)
            return TaskResult(interrupted=True)
        result.metric_states = metrics.states()
        return result

    def predict_task(self, order: TaskOrder) -> TaskResult:
        from elasticdl.model import prediction
        result = TaskResult()  # no loss, no batches: they would show up as a training loss
        outputs = []
        first = True

        def step(features, _done: int) -> bool:
            nonlocal first
            features = features_of(features)  # a dataset_fn that yields labels in prediction mode too
            if first:
                self._use_latest(features)
                first = False
            predictions = self.trainer.model(features, training=False)
            if self.spec.prediction_outputs_processor is not None:
                if self._processor is None:
                    self._processor = self.spec.prediction_outputs_processor()
                self._processor.process(predictions, self.worker_id)  # tensors, as the original passed
            else:
                outputs.append(_to_numpy(predictions))
            result.records += _batch_size(predictions)
            return True

        self._run_batches(order, Mode.PREDICTION, step)
        if self.spec.prediction_outputs_processor is None:
            prediction.write_part(self.prediction_outputs, order.path, order.start, outputs,
                                  prediction.output_names(self.trainer.model))
        return result

    def train_task(self, order: TaskOrder) -> TaskResult:
        total = order.end - order.start
        result = TaskResult()
        self._task_progress = 0
        batch_index = 0

        def step(batch, done: int) -> bool:
            nonlocal batch_index
            features, labels, sample_weight = unpack(batch, self.spec, Mode.TRAINING)
            self._batch_context = (f"task {order.task_id} ({order.path} records {order.start}-{order.end - 1}), "
                                   f"batch {batch_index}")
            batch_index += 1
            # The PS keep how far each task's records were applied (a checkpoint's data position).
            self._batch_position = BatchPosition(order.task_id, order.handout, order.start + done,
                                                 done - self._task_progress, order.ticket)
            loss = self.train_batch(features, labels, sample_weight)
            if math.isfinite(loss):  # a non-finite batch was not pushed
                result.loss_sum += loss
                result.batches += 1
            if done != self._task_progress:
                self._task_progress = done
                self.master.report_progress(order.task_id, done, self.model_version)  # not awaited
            if self.stop_requested and done < total:
                result.interrupted = True  # the master requeues records [done, end)
                result.records = self._task_progress
                return False
            return True

        self._prefetch_first_pull()
        if self.progressive is not None:
            self.progressive.start()
        try:
            self._run_batches(order, Mode.TRAINING, step)
            self._finish_task_pushes()  # done, or left on SIGTERM: the master counts its records as trained
        except BaseException:
            # Taken back: another hand-out trains the records. Failed: the master requeues from
            # the PS's mark. Either way what was not pushed is trained again, never twice.
            self._leave_task()
            raise
        finally:
            self._batch_position = None
            self._drop_prefetched_pull()  # unused when no batch was trained
        self._batch_context = ""
        if not result.interrupted:
            # Chunks that dataset_fn filtered out entirely are done too; skipped bad records are not.
            result.records = total - len(self._task_bad)
        if self.progressive is not None:
            result.metric_states = self.progressive.take()  # merged per window by the master
        return result


def _close_records(loaded) -> None:
    """A read-ahead not taken: a stream's reader thread stops."""
    records, _ = loaded
    if isinstance(records, ColumnStream):
        records.close()


def _to_numpy(values):
    if isinstance(values, dict):
        return {k: np.asarray(v) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return [np.asarray(v) for v in values]
    return np.asarray(values)


def _batch_size(labels) -> int:
    first = labels
    while isinstance(first, (dict, list, tuple)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(np.shape(first)[0])
