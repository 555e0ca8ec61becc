"""BatchLoop: the worker's one batch loop, carrying out the steps its ConsistencyPolicy returns.

Every mode (sync, async, SSP, --push_steps, overlap) goes through the same loop: ask
``policy.next_step()``, carry the step out, tell the policy what happened (worker/steps.py
names the steps, worker/batch_steps.py orders them). There is one push path (``_send``, also
under the overlap exchange's background thread) and one retry rule: a step that finds a PS
unreachable is tried again once the PS is back (``_with_ps_retries``), after the policy heard
of the reconnect, so it pulls everything before it computes or pushes again.

Hot path: a step is a small frozen dataclass and a dict lookup; the gradients are neither
copied nor sent twice, and no call is added to the PS or the master.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from elasticdl.errors import TrainingDivergedError
from elasticdl.model.slicing import held_variables
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.worker.overlap import Exchange
from elasticdl.worker.steps import Gradients, PullRequest, Step, StepKind

logger = logging.getLogger(__name__)

# A sync worker waits this long for the others' gradients before it computes again on
# the same version (a safety net: the master lowers grads_to_wait when workers leave).
SYNC_WAIT_SECONDS = 30.0
# How long a worker keeps retrying while a parameter server is down (being relaunched).
PS_RECONNECT_SECONDS = 120.0
# A worker told to wait for a task looks this often whether a PS holds no model (and refills it).
REFILL_PROBE_SECONDS = 5.0
# A batch whose loss or gradients are NaN or Inf is not pushed; this many in a row (across
# tasks) and the job fails: training diverged, and no retry of the task can help.
MAX_NONFINITE_BATCHES = 3


@dataclass(frozen=True)
class _Outbox:
    """Gradients on their way to the PS: kept until every PS took them (a retry sends them again)."""

    parts: list  # per PS
    versions: tuple[int, ...]
    learning_rate: float | None  # None: the optimizer's own (0 is a rate: no update)
    position: BatchPosition | None


def refill_version(pulled: list) -> int:
    """The version to give an empty PS: the one the initialized PS are at (0: none is), so that
    every shard of a sync job keeps one version (docs/consistency.md)."""
    return max((r.version for r in pulled if r.initialized), default=0)


class BatchLoop:
    """The training half of Worker (worker/worker.py): a mixin over its attributes (ps, trainer,
    master, consistency, ...)."""

    def _init_batch_loop(self) -> None:
        self._grads = None  # the last COMPUTE's gradients, until a PUSH takes them
        self._outbox: _Outbox | None = None
        self._batch: tuple | None = None  # (features, labels, sample_weight) of the batch under way
        self._loss = float("nan")
        self._pause = self._blocked = 0.0  # SSP: the next pause, and the time blocked not reported yet
        self._probed_at = time.monotonic()  # the last look for an empty PS while waiting for a task
        self._steps: dict[StepKind, Callable[[Step], None]] = {
            StepKind.WAIT: self._wait_step, StepKind.SETTLE: lambda step: self._settle_exchange(),
            StepKind.PULL: lambda step: self._pull_with(step.pull), StepKind.COMPUTE: self._compute_step,
            StepKind.PUSH: self._push_step,
        }

    def train_batch(self, features, labels, sample_weight=None) -> float:
        """Train one batch; rides out a parameter server restart (it comes back on its address).
        Returns its loss (NaN: not finite, not pushed)."""
        self._with_ps_retries(lambda: self._before_batch(features))
        self._batch, self._loss, self._pause = (features, labels, sample_weight), float("nan"), 0.005
        self.consistency.batch_started()
        try:
            self._run_steps()
        finally:
            self._batch = None
        return self._loss

    def _finish_task_pushes(self) -> None:
        """Before a task is reported: its gradients must be on the PS (the master counts its
        records as trained). Settles the exchange in flight, pushes what is accumulated."""
        self.consistency.task_ending()
        self._run_steps()

    def _leave_task(self) -> None:
        """The task failed or was taken back: the master requeues from the PS's marks, so no push
        may land after the report (the exchange in flight ends first) and what was not pushed is
        dropped: it is trained again, never twice."""
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.wait()
        if self._accumulator.batches:
            logger.info("dropped the gradients of %d batches not pushed: their records are trained again",
                        self._accumulator.batches)
            self._accumulator.clear()
        self.consistency.task_left()

    def _run_steps(self) -> None:
        policy = self.consistency
        outage: list[float] = []  # the current outage's deadline and pause (none: all PS reachable)
        while (step := policy.next_step()).kind is not StepKind.DONE:
            try:
                self._steps[step.kind](step)
                outage.clear()
            except grpc.RpcError as err:
                self._ps_unreachable(err, outage)  # the policy decides the next step anew

    def _with_ps_retries(self, call: Callable[[], object]):
        """``call()``, run again while a PS is unreachable (restarting), as a step is."""
        outage: list[float] = []
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                self._ps_unreachable(err, outage)

    def _ps_unreachable(self, err: grpc.RpcError, outage: list[float]) -> None:
        """The one retry rule: re-raise unless a PS is UNAVAILABLE for less than
        PS_RECONNECT_SECONDS; else pause (doubling, up to 2 s) and tell the policy."""
        if not outage:
            outage += [time.monotonic() + PS_RECONNECT_SECONDS, 0.2]
        if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > outage[0]:
            raise err
        logger.warning("a parameter server is unreachable (%s); retrying", err.details())
        time.sleep(outage[1])
        outage[1] = min(outage[1] * 2, 2.0)
        # It may come back older (from a checkpoint) or empty: pull everything before computing or pushing.
        self.consistency.ps_reconnected()

    def _before_batch(self, features) -> None:
        """The first batch builds the model and gives the PS its parameters (or pulls them)."""
        self._startup.mark("records and dataset_fn")
        if not self.trainer.built:
            self.trainer.ensure_built(features)
            self._initialize_ps()
            self._startup.mark("variables and first pull")

    # ------------------------------------------------------------ the steps

    def _wait_step(self, step: Step) -> None:
        """SSP: report the clock; while too far ahead of the slowest worker, pause and report again."""
        policy = self.consistency
        clock, slowest = self.master.report_clock(policy.clock, self._blocked)
        self.blocked_seconds += self._blocked
        self._blocked = 0.0
        if policy.clock_reported(clock, slowest) and not policy.in_flight:
            time.sleep(self._pause)
            self._blocked, self._pause = self._pause, min(self._pause * 2, 0.2)

    def _compute_step(self, step: Step) -> None:
        features, labels, sample_weight = self._batch
        if self.progressive is not None:  # scored on the parameters its gradients are computed on
            self.progressive.score(self._batch_position, self.trainer, features, labels)
        if sample_weight is None:  # the two-argument call that trainers without weights take
            loss, grads = self.trainer.compute_gradients(features, labels)
        else:
            loss, grads = self.trainer.compute_gradients(features, labels, sample_weight)
        self._startup.mark("gradients (tracing)")
        if not (math.isfinite(loss) and getattr(self.trainer, "last_step_finite", True)):
            self._loss = self._nonfinite_batch(loss)
            self.consistency.computed(False)
            return
        self._nonfinite_in_row = 0
        self._loss = loss
        if step.keep:  # --push_steps: applied to the local copy, pushed with the next ones
            self._accumulator.add(grads, self._batch_position)
            self.trainer.apply_locally(grads, self._learning_rate())
            self.batches_trained += 1
        else:
            self._grads = grads
        self.consistency.computed(True)

    def _push_step(self, step: Step) -> None:
        policy = self.consistency
        if step.gradients is not Gradients.AGAIN:
            if step.gradients is Gradients.ACCUMULATED:  # their mean, named by the last batch's position
                grads, position = self._accumulator.means()
            else:
                grads, position, self._grads = self._grads, self._batch_position, None
            self._outbox = _Outbox(self.ps.split(grads), step.versions, self._learning_rate(), position)
        outbox = self._outbox
        if step.background:
            self.trainer.apply_locally(grads, outbox.learning_rate)  # the next batch computes on it
            self._start_exchange(outbox, step)
            return
        answers = self._send(outbox, step.to_ps, step.versions, step.want_parameters)
        # Every PS's part at once: a sliced variable is then assigned once, whole (model/slicing.py).
        answered = {n: v for a in answers.values() if a.params is not None for n, v in a.params.items()}
        if answered:
            self.trainer.set_params(answered)
        dropped = policy.dropped
        taken = policy.pushed(answers, step)  # raises TaskTakenBackError, PushRejectedError
        if policy.unpushed == 0 and self._accumulator.batches:
            self._accumulator.clear()  # taken, or given up
        if policy.dropped != dropped:
            logger.warning("dropped gradients (%s): PS refused them as stale %d times in a row",
                           step.gradients.value, policy.max_push_tries)
        if taken is not None or policy.dropped != dropped:
            self._outbox = None  # taken or given up: its arrays need not outlive the push
        if taken is not None:
            self._pushed(batch=taken is Gradients.BATCH)
            if taken is Gradients.BATCH and step.apply_locally:
                self.trainer.apply_locally(grads, outbox.learning_rate)

    def _send(self, outbox: _Outbox, to_ps, versions: tuple[int, ...], want_parameters: bool = False) -> dict:
        """The one push path (on the worker's thread, or the exchange's)."""
        return self.ps.push_gradients({ps: outbox.parts[ps] for ps in to_ps}, list(versions),
                                      outbox.learning_rate, self.worker_id, want_parameters=want_parameters,
                                      batch=outbox.position)

    def _pushed(self, batch: bool) -> None:
        if not self.pushes:
            self._startup.mark("push")
            logger.info("first gradient pushed (model version %d) %s", self.model_version, self._startup.finish())
        self.pushes += 1
        if batch:
            self.batches_trained += 1

    # ------------------------------------------------------------ overlap: the exchange

    def _start_exchange(self, outbox: _Outbox, step: Step) -> None:
        """Push (and pull after it) on the background thread while the next batch computes."""
        policy = self.consistency

        def prepare():  # on this thread; again for a retry, after a reconnect maybe
            request = policy.pull_request() if step.pull is not None else None
            return lambda: self._exchange_once(outbox, request)

        self._exchange = Exchange(self._background(), prepare)
        policy.started_in_background(step)

    def _exchange_once(self, outbox: _Outbox, request: PullRequest | None):
        """The background half: only calls to the PS (their answers are taken by SETTLE)."""
        answers = self._send(outbox, range(self.ps.num_ps), outbox.versions)
        results = None
        if request is not None and all(answer.outcome.accepted for answer in answers.values()):
            results = self.ps.pull(list(request.versions), list(request.wait_for_newer), SYNC_WAIT_SECONDS)
        return answers, request, results

    def _settle_exchange(self) -> None:
        """SETTLE: wait for the exchange in flight and take its answers as a synchronous push's
        and pull's. Its error is raised here (PS unreachable: the retry runs it again)."""
        if self._exchange is None:
            return
        answers, request, results = self._exchange.result()
        self._exchange = None
        if not self.consistency.settled(answers):  # raises TaskTakenBackError, PushRejectedError
            return  # some PS refused it as stale: the next step pushes it again
        self._outbox = None
        self._pushed(batch=True)
        if results is None:
            return
        if request != self.consistency.pull_request():  # a PS reconnected meanwhile: what it sent may be older
            self._pull()
        else:
            self._load_pulled(request, results)

    def _background(self) -> ThreadPoolExecutor:
        if self._exchanges is None:
            self._exchanges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange")
        return self._exchanges

    # ------------------------------------------------------------ pulls

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

    def _pull(self, everything: bool = False) -> None:
        """Pull what the policy asks for (``everything``: every parameter of every PS)."""
        self._pull_with(self.consistency.pull_request(everything))

    def _pull_with(self, request: PullRequest) -> None:
        prefetched, self._prefetched_pull = self._prefetched_pull, None
        if prefetched is not None:
            asked, results = prefetched.result()  # its error is raised here, and the retry pulls anew
            if asked == request:  # nothing it was asked on changed since
                self._load_pulled(request, results)
                return
        results = self.ps.pull(list(request.versions), list(request.wait_for_newer), SYNC_WAIT_SECONDS)
        self._load_pulled(request, results)

    def _load_pulled(self, request: PullRequest, results: list) -> None:
        """Load what a pull of ``request`` answered (an empty PS is given this worker's copy first)."""
        if self._refill_empty(results):
            results = self.ps.pull(list(request.versions))
        for ps, result in enumerate(results):
            if not result.initialized:
                raise RuntimeError(f"PS {ps} has no model")
        pulled = {n: v for r in results if r.params for n, v in r.params.items()}
        if pulled:
            self.trainer.set_params(pulled)
        for ps in self.consistency.pulled(request, [r.version for r in results]):
            logger.warning(
                "PS %d did not move past version %d within %.0fs; computing on it again",
                ps, results[ps].version, SYNC_WAIT_SECONDS,
            )
        self.trainer.embeddings.snapshot_id = 0

    def _refill_empty(self, results: list) -> bool:
        """Give each PS that a pull found empty (relaunched without a checkpoint) this worker's copy
        of its variables; True if one was. It starts at the version the others are at, so that
        every shard of a sync job keeps one version (the simulator: a PS refilled at 0 stayed behind)."""
        empty = [ps for ps, r in enumerate(results) if not r.initialized]
        if not (empty and self.may_initialize_ps and self.trainer.built):
            return False
        version = refill_version(results)
        logger.warning("PS %s came back empty; re-initializing it with this worker's parameters at version %d",
                       empty, version)
        self.ps.push_model(self.trainer.get_params(), version=version, non_trainable=self.trainer.non_trainable)
        if self.trainer.embeddings.infos:  # its tables too; their rows start over (docs/embeddings.md)
            self.ps.push_embedding_table_infos(list(self.trainer.embeddings.infos.values()))
        return True

    def _refill_while_waiting(self) -> None:
        """The master has no task now: at most every REFILL_PROBE_SECONDS, look whether a PS holds
        no model and refill it. A PS relaunched empty once every task was done has no batch left
        to pull for it, and a sync job's end waits for it (LevelVersions; the simulator, seed 1475:
        the job ended with that shard missing). The policy is not told: a pull made here must
        not stand in for the one the next batch makes (it may wait for a version)."""
        now = time.monotonic()
        if not (self.trainer.built and self.may_initialize_ps) or now - self._probed_at < REFILL_PROBE_SECONDS:
            return
        self._probed_at = now
        self._with_ps_retries(lambda: self._refill_empty(self.ps.pull(self.consistency.versions)))

    def _initialize_ps(self) -> None:
        """The first worker to get here gives the PS its freshly built model; the rest pull."""
        pulled = self.ps.pull([-1] * self.ps.num_ps)
        if not all(p.initialized for p in pulled):
            if not self.may_initialize_ps:
                raise RuntimeError(
                    "the parameter servers hold no model: evaluate and predict need "
                    "--checkpoint_dir_for_init"
                )
            # At the others' version: a worker that starts while a PS was relaunched empty is a
            # refill too (found by the simulator, seed 3046: a new worker refilled it at 0).
            accepted = self.ps.push_model(self.trainer.get_params(), version=refill_version(pulled),
                                          non_trainable=self.trainer.non_trainable)
            if any(accepted):
                logger.info("initialized the parameter servers with this worker's model")
        if self.trainer.embeddings.infos:  # idempotent: restored tables keep their rows
            self.ps.push_embedding_table_infos(list(self.trainer.embeddings.infos.values()))
        self._pull(everything=True)
        held = held_variables(set().union(*(p.params for p in self.ps.pull([-1] * self.ps.num_ps))))
        missing = sorted(set(self.trainer.variables).union(self.trainer.non_trainable) - held)
        if missing:
            raise RuntimeError(
                f"the parameter servers do not hold {missing[:5]}: was the model changed "
                "since the checkpoint in --checkpoint_dir_for_init was made? (A checkpoint written "
                "before non-trainable variables lived on the parameter servers holds none of them.)"
            )

    # ------------------------------------------------------------ odds and ends

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

    def _learning_rate(self) -> float | None:
        """The model zoo's rate for this version; None: the optimizer's own (0 is a rate: no update)."""
        if self.spec.learning_rate_scheduler is None:
            return None
        rate = self.spec.learning_rate_scheduler(self.model_version)
        return None if rate is None else float(rate)
