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
from elasticdl.model.spec import DatasetMetadata, ModelSpec
from elasticdl.model.trainer import Trainer
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.master_client import MasterClient, TaskOrder
from elasticdl.rpc.ps_client import PSClient
from elasticdl.worker.accumulation import GradientAccumulator
from elasticdl.worker.consistency import ConsistencyPolicy, PullRequest, TaskTakenBackError
from elasticdl.worker.overlap import Exchange
from elasticdl.worker.startup import StartupClock
from elasticdl.worker.task_data import BatchStream

logger = logging.getLogger(__name__)

# A sync-mode gradient rejected as stale is recomputed on fresh parameters; past this
# many tries in a row the batch is skipped (other workers are moving the model anyway).
MAX_PUSH_TRIES = 64
# A sync worker waits this long for the others' gradients before it computes again on
# the same version (a safety net: the master lowers grads_to_wait when workers leave).
SYNC_WAIT_SECONDS = 30.0
# How long a worker keeps retrying while a parameter server is down (being relaunched).
PS_RECONNECT_SECONDS = 120.0
# A batch whose loss or gradients are NaN or Inf is not pushed; this many in a row (across
# tasks) and the job fails: training diverged, and no retry of the task can help.
MAX_NONFINITE_BATCHES = 3


@dataclass
class TaskResult:
    records: int = 0
    loss_sum: float = 0.0
    batches: int = 0
    metric_states: dict | None = None
    interrupted: bool = False  # left before the end: `records` is the trained prefix


class Worker:
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
        # The next task's records, read while this one trains (the master's read_ahead promise).
        self._task_reads = TaskPrefetch(self._load_records, dispose=_close_records)

    def run(self) -> None:
        try:
            self._run_tasks()
        finally:
            self._drop_exchange()  # none is left after a task; an error past the task loop may leave one
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
        for pulled in self.ps.pull_snapshot(order.snapshot_id):
            self.trainer.set_params(pulled.params)
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
            features, labels = batch
            if not loaded:
                self._use_snapshot(order, features)
                loaded = True
            metrics.update(labels, self.trainer.model(features, training=False))
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
            if isinstance(features, tuple) and len(features) == 2:
                features = features[0]  # a dataset_fn that yields labels in prediction mode too
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
            prediction.write_part(self.prediction_outputs, order.path, order.start, outputs)
        return result

    def train_task(self, order: TaskOrder) -> TaskResult:
        total = order.end - order.start
        result = TaskResult()
        self._task_progress = 0
        batch_index = 0

        def step(batch, done: int) -> bool:
            nonlocal batch_index
            features, labels = batch
            self._batch_context = (f"task {order.task_id} ({order.path} records {order.start}-{order.end - 1}), "
                                   f"batch {batch_index}")
            batch_index += 1
            # The PS keep how far each task's records were applied (a checkpoint's data position).
            self._batch_position = BatchPosition(order.task_id, order.handout, order.start + done,
                                                 done - self._task_progress)
            loss = self.train_batch(features, labels)
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
        try:
            self._run_batches(order, Mode.TRAINING, step)
            # Before the task is reported (done, or left on SIGTERM): the master counts its
            # records as trained, so their gradients must be on the PS.
            self._with_ps_retries(self._settle_exchange)
            self._with_ps_retries(self._push_accumulated)
        except BaseException:
            # Taken back: another hand-out trains the records. Failed: the master requeues from
            # the PS's mark. Either way what was not pushed is trained again, never twice.
            self._drop_exchange()
            self._drop_accumulated()
            raise
        finally:
            self._batch_position = None
            self._drop_prefetched_pull()  # unused when no batch was trained
        self._batch_context = ""
        if not result.interrupted:
            # Chunks that dataset_fn filtered out entirely are done too; skipped bad records are not.
            result.records = total - len(self._task_bad)
        return result

    def train_batch(self, features, labels) -> float:
        """Train one batch; rides out a parameter server restart (it comes back on its address)."""
        if self.consistency.overlap:
            return self._train_batch_overlapped(features, labels)
        if not self.consistency.accumulates:
            return self._with_ps_retries(lambda: self._train_batch_once(features, labels))
        # Accumulated pushes: the batch is trained once, and its push (every n-th batch) retried
        # on its own, so a PS restart during the push does not add the batch's gradients twice.
        loss = self._with_ps_retries(lambda: self._accumulate_batch(features, labels))
        if self.consistency.push_due():
            self._with_ps_retries(self._push_accumulated)
        return loss

    def _with_ps_retries(self, call: Callable[[], float | None]):
        deadline, pause = time.monotonic() + PS_RECONNECT_SECONDS, 0.2
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                logger.warning("a parameter server is unreachable (%s); retrying", err.details())
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
                # It may come back older (from a checkpoint) or empty: pull everything again.
                self.consistency.ps_reconnected()

    def _before_batch(self, features) -> None:
        """What every trained batch needs first: the model built and the PS holding it (the
        first batch), and, in SSP, this worker within the staleness bound."""
        self._startup.mark("records and dataset_fn")
        if not self.trainer.built:
            self.trainer.ensure_built(features)
            self._initialize_ps()
            self._startup.mark("variables and first pull")
        if self.consistency.bounded:
            self._wait_within_staleness_bound()

    def _train_batch_once(self, features, labels) -> float:
        self._before_batch(features)
        policy = self.consistency
        pending = set(range(self.ps.num_ps))
        loss = 0.0
        for _ in range(MAX_PUSH_TRIES):
            if policy.must_pull():
                self._pull()
            loss, grads = self.trainer.compute_gradients(features, labels)
            self._startup.mark("gradients (tracing)")
            if not (math.isfinite(loss) and getattr(self.trainer, "last_step_finite", True)):
                return self._nonfinite_batch(loss)
            self._nonfinite_in_row = 0
            parts = self.ps.split(grads)
            lr = self._learning_rate()
            answers = self.ps.push_gradients(
                {ps: parts[ps] for ps in pending}, policy.versions, lr, self.worker_id,
                want_parameters=policy.wants_push_parameters, batch=self._batch_position,
            )
            pending = policy.push_answered(answers)  # those that refused it as stale
            for answer in answers.values():
                if answer.params is not None:
                    self.trainer.set_params(answer.params)
            if not pending:
                if not self.pushes:
                    self._first_push_logged()
                self.batches_trained += 1
                self.pushes += 1
                policy.batch_pushed()
                if policy.applies_locally:
                    self.trainer.apply_locally(grads, lr)
                return loss
        logger.warning("skipped a batch: its gradients were stale %d times in a row", MAX_PUSH_TRIES)
        return loss

    def _train_batch_overlapped(self, features, labels) -> float:
        """--overlap_communication: compute this batch on the parameters held (the exchange in
        flight, if any, is the last batch's push and maybe a pull), then settle that exchange
        and start this batch's. A PS restart during the compute computes it again; during the
        exchange, pushes the same gradients again (worker/overlap.py)."""
        policy = self.consistency
        versions = policy.versions

        def compute():
            nonlocal versions
            self._before_batch(features)
            if policy.must_pull():  # none in flight (a task's first batch), or after an SSP wait
                self._pull()
            versions = policy.versions  # what the gradients are computed on: the PS counts their staleness
            return self.trainer.compute_gradients(features, labels)

        loss, grads = self._with_ps_retries(compute)
        self._startup.mark("gradients (tracing)")
        if not (math.isfinite(loss) and getattr(self.trainer, "last_step_finite", True)):
            return self._nonfinite_batch(loss)
        self._nonfinite_in_row = 0
        lr = self._learning_rate()
        parts = self.ps.split(grads)
        self._with_ps_retries(self._settle_exchange)  # at most one in flight
        if policy.applies_locally:  # on what the settled exchange pulled, if it did
            self.trainer.apply_locally(grads, lr)
        pull = policy.pulls_after_push()
        position = self._batch_position

        def prepare():  # on this thread; again for a retry, after a reconnect maybe
            request = policy.pull_request() if pull else None
            return lambda: self._exchange_once(parts, versions, lr, position, request)

        self._exchange = Exchange(self._background(), prepare)
        policy.exchange_started()
        return loss

    def _exchange_once(self, parts: list, versions: list[int], lr: float | None, position: BatchPosition | None,
                       request: PullRequest | None):
        """The background half of an exchange: only calls to the PS (their answers are taken
        on the worker's thread, by _settle_exchange)."""
        answers = self.ps.push_gradients(dict(enumerate(parts)), versions, lr, self.worker_id,
                                         want_parameters=False, batch=position)
        results = None
        if request is not None and all(answer.outcome.accepted for answer in answers.values()):
            results = self.ps.pull(list(request.versions), list(request.wait_for_newer), SYNC_WAIT_SECONDS)
        return answers, request, results, parts, versions, lr, position

    def _settle_exchange(self) -> None:
        """Wait for the exchange in flight and take its answers as a synchronous push's and
        pull's. Its error is raised here (PS unreachable: _with_ps_retries runs it again)."""
        if self._exchange is None:
            return
        answers, request, results, parts, versions, lr, position = self._exchange.result()
        self._exchange = None
        policy = self.consistency
        try:
            pending = policy.push_answered(answers)  # raises TaskTakenBackError, PushRejectedError
        except BaseException:
            policy.exchange_dropped()  # the next batch pulls
            raise
        policy.exchange_settled()
        for _ in range(MAX_PUSH_TRIES):  # async PS take every gradient; kept for safety
            if not pending:
                break
            pending = policy.push_answered(self.ps.push_gradients(
                {ps: parts[ps] for ps in pending}, versions, lr, self.worker_id, batch=position))
        if pending:
            logger.warning("dropped a batch's gradients: PS %s refused them as stale %d times", sorted(pending),
                           MAX_PUSH_TRIES)
            return
        if not self.pushes:
            self._first_push_logged()
        self.batches_trained += 1
        self.pushes += 1
        policy.batch_pushed()
        if results is None:
            return
        if request.versions != tuple(policy.versions):  # a PS reconnected meanwhile: what it sent may be older
            self._pull()
        else:
            self._load_pulled(request, results)

    def _background(self) -> ThreadPoolExecutor:
        if self._exchanges is None:
            self._exchanges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange")
        return self._exchanges

    def _prefetch_first_pull(self) -> None:
        """Sync: start the pull a training task's first batch makes while its records are read
        and its first batch parsed (after a push still waiting for the others' gradients, that
        pull waits for the new version: the wait overlaps the reading too)."""
        policy = self.consistency
        if policy.use_async or not self.trainer.built or not policy.must_pull():
            return

        def prepare():
            request = policy.pull_request()
            return lambda: (request, self.ps.pull(list(request.versions), list(request.wait_for_newer),
                                                  SYNC_WAIT_SECONDS))

        self._prefetched_pull = Exchange(self._background(), prepare)

    def _drop_prefetched_pull(self) -> None:
        prefetched, self._prefetched_pull = self._prefetched_pull, None
        if prefetched is not None:
            prefetched.wait()

    def _drop_exchange(self) -> None:
        """Leave the exchange in flight (its task failed or was taken back), once it ended: the
        master requeues from the PS's marks, so no push may land after the report."""
        exchange, self._exchange = self._exchange, None
        if exchange is None:
            return
        exchange.wait()
        self.consistency.exchange_dropped()

    def _accumulate_batch(self, features, labels) -> float:
        """--push_steps: compute the batch's gradients, apply them locally and keep them to push."""
        self._before_batch(features)
        policy = self.consistency
        if policy.must_pull():
            self._pull()
        loss, grads = self.trainer.compute_gradients(features, labels)
        self._startup.mark("gradients (tracing)")
        if not (math.isfinite(loss) and getattr(self.trainer, "last_step_finite", True)):
            return self._nonfinite_batch(loss)
        self._nonfinite_in_row = 0
        self._accumulator.add(grads, self._batch_position)
        self.trainer.apply_locally(grads, self._learning_rate())
        self.batches_trained += 1
        policy.batch_accumulated()
        return loss

    def _push_accumulated(self) -> None:
        """Push the accumulated gradients (their mean, named by the last batch's position, with the
        records of all of them). A retry after a lost answer is taken once: the PS's mark is past it."""
        if not self._accumulator.batches:
            return
        policy = self.consistency
        # Kept until every PS took them: a retry (PS restart) pushes the same mean again.
        grads, position = self._accumulator.means()
        parts = self.ps.split(grads)
        pending = set(range(self.ps.num_ps))
        for _ in range(MAX_PUSH_TRIES):
            answers = self.ps.push_gradients(
                {ps: parts[ps] for ps in pending}, policy.versions, self._learning_rate(), self.worker_id,
                want_parameters=False, batch=position,
            )
            pending = policy.push_answered(answers)  # async PS take every gradient; kept for safety
            if not pending:
                break
        self._accumulator.clear()
        if pending:
            logger.warning("dropped accumulated gradients: PS %s refused them as stale %d times", sorted(pending),
                           MAX_PUSH_TRIES)
        if not self.pushes:
            self._first_push_logged()
        self.pushes += 1
        policy.accumulation_pushed()

    def _first_push_logged(self) -> None:
        self._startup.mark("push")
        logger.info("first gradient pushed (model version %d) %s", self.model_version, self._startup.finish())

    def _drop_accumulated(self) -> None:
        if self._accumulator.batches:
            logger.info("dropped the gradients of %d batches not pushed: their records are trained again",
                        self._accumulator.batches)
            self._accumulator.clear()
            self.consistency.accumulation_dropped()

    def _nonfinite_batch(self, loss: float) -> float:
        """A batch whose loss or gradients are NaN/Inf is not pushed (the PS would refuse it, and
        it would spoil the model); MAX_NONFINITE_BATCHES in a row fail the job. Returns NaN."""
        self._nonfinite_in_row += 1
        what = f"the loss is {loss}" if not math.isfinite(loss) else "the gradients hold NaN or Inf"
        where = self._batch_context or f"batch {self.batches_trained}"
        if self._nonfinite_in_row >= MAX_NONFINITE_BATCHES:
            raise TrainingDivergedError(
                f"{where}: {what}; {MAX_NONFINITE_BATCHES} batches in a row had a NaN or Inf loss or "
                f"gradients (none of them was pushed): training diverged. Lower the learning rate "
                f"(optimizer() in {self.spec.module_path}), look for NaN, Inf or huge values in the inputs "
                "and labels, and for log(0) or a division by 0 in the model and loss()."
            )
        logger.warning("%s: %s; the batch is skipped (%d of %d in a row fail the job)", where, what,
                       self._nonfinite_in_row, MAX_NONFINITE_BATCHES)
        return float("nan")

    def _wait_within_staleness_bound(self) -> None:
        """SSP: block while this worker is too far ahead of the slowest worker holding a task."""
        blocked, pause = 0.0, 0.005
        while True:
            clock, slowest = self.master.report_clock(self.consistency.clock, blocked)
            self.blocked_seconds += blocked
            if not self.consistency.must_wait(clock, slowest):
                return
            if self._exchange is not None:
                # Settled, its batch joins the clock and its update the parameters: no lag is left.
                self._with_ps_retries(self._settle_exchange)
                blocked = 0.0
                continue
            self.consistency.held_back()  # overlap: the pull follows the wait, as without overlap
            time.sleep(pause)
            blocked, pause = pause, min(pause * 2, 0.2)

    def _learning_rate(self) -> float | None:
        """The model zoo's rate for this version; None: the optimizer's own (0 is a rate: no update)."""
        if self.spec.learning_rate_scheduler is None:
            return None
        rate = self.spec.learning_rate_scheduler(self.model_version)
        return None if rate is None else float(rate)

    def _initialize_ps(self) -> None:
        """The first worker to get here gives the PS its freshly built model; the rest pull."""
        pulled = self.ps.pull([-1] * self.ps.num_ps)
        if not all(p.initialized for p in pulled):
            if not self.may_initialize_ps:
                raise RuntimeError(
                    "the parameter servers hold no model: evaluate and predict need "
                    "--checkpoint_dir_for_init"
                )
            accepted = self.ps.push_model(self.trainer.get_params(), non_trainable=self.trainer.non_trainable)
            if any(accepted):
                logger.info("initialized the parameter servers with this worker's model")
        if self.trainer.embeddings.infos:  # idempotent: restored tables keep their rows
            self.ps.push_embedding_table_infos(list(self.trainer.embeddings.infos.values()))
        self._pull(everything=True)
        held = set().union(*(p.params for p in self.ps.pull([-1] * self.ps.num_ps)))
        missing = sorted(set(self.trainer.variables).union(self.trainer.non_trainable) - held)
        if missing:
            raise RuntimeError(
                f"the parameter servers do not hold {missing[:5]}: was the model changed "
                "since the checkpoint in --checkpoint_dir_for_init was made? (A checkpoint written "
                "before non-trainable variables lived on the parameter servers holds none of them.)"
            )

    def _pull(self, everything: bool = False) -> None:
        """Pull what the policy asks for (``everything``: every parameter of every PS)."""
        prefetched, self._prefetched_pull = self._prefetched_pull, None
        if prefetched is not None and not everything:
            request, results = prefetched.result()  # its error is raised here, and the retry pulls anew
            if request == self.consistency.pull_request():  # nothing it was asked on changed since
                self._load_pulled(request, results)
                return
        request = self.consistency.pull_request(everything)
        results = self.ps.pull(list(request.versions), list(request.wait_for_newer), SYNC_WAIT_SECONDS)
        self._load_pulled(request, results)

    def _load_pulled(self, request: PullRequest, results: list) -> None:
        """Load what a pull of ``request`` answered (an empty PS is given this worker's copy first)."""
        empty = [ps for ps, r in enumerate(results) if not r.initialized]
        if empty and self.may_initialize_ps and self.trainer.built:
            # A PS relaunched without a checkpoint: give it our copy of its variables.
            logger.warning("PS %s came back empty; re-initializing it with this worker's parameters", empty)
            self.ps.push_model(self.trainer.get_params(), non_trainable=self.trainer.non_trainable)
            if self.trainer.embeddings.infos:  # its tables too; their rows start over (docs/embeddings.md)
                self.ps.push_embedding_table_infos(list(self.trainer.embeddings.infos.values()))
            results = self.ps.pull(list(request.versions))
        for ps, result in enumerate(results):
            if not result.initialized:
                raise RuntimeError(f"PS {ps} has no model")
        for result in results:
            if result.params:
                self.trainer.set_params(result.params)
        for ps in self.consistency.pulled(request, [r.version for r in results]):
            logger.warning(
                "PS %d did not move past version %d within %.0fs; computing on it again",
                ps, results[ps].version, SYNC_WAIT_SECONDS,
            )
        self.trainer.embeddings.snapshot_id = 0


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
