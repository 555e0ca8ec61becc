"""A simulated worker: the real worker's batch loop as a coroutine, on the real ConsistencyPolicy.

It mirrors elasticdl/worker/worker.py step for step (get a task, pull when the policy says,
compute, push to every PS, take the answers, report), with the model replaced by the numpy
stand-in (sim/model.py). The calls go through the simulated network; a PS that does not
answer is retried as ``_with_ps_retries`` does, telling the policy ``ps_reconnected()``.
Each push also carries the keys of its records, for the simulator's oracle only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elasticdl.master.task_manager import NoTask, TaskType
from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.metrics import MetricsAccumulator
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.sim.model import EMBEDDING_IDS, Dataset, LinearModel, eval_metrics, split
from elasticdl.sim.modes import Mode
from elasticdl.sim.scheduler import Await, Sleep
from elasticdl.sim.transport import Call, Unavailable
from elasticdl.worker.batch_loop import REFILL_PROBE_SECONDS
from elasticdl.worker.consistency import ConsistencyPolicy, PushRejectedError, TaskTakenBackError

MAX_PUSH_TRIES = 64  # as elasticdl/worker/worker.py
PS_RECONNECT_SECONDS = 120.0
SYNC_WAIT_SECONDS = 30.0
MINIBATCH = 2
WAIT_SECONDS = 0.05  # a worker told WAIT asks again after this long
COMPUTE_SECONDS = 0.003


@dataclass
class Accumulated:
    """--push_steps: the gradients of batches not pushed yet, and their records."""

    grads: list[dict] = field(default_factory=list)
    position: BatchPosition | None = None
    keys: list = field(default_factory=list)

    def add(self, grads: dict, position: BatchPosition, keys: list) -> None:
        self.grads.append(grads)
        records = position.records + (self.position.records if self.position else 0)
        self.position = BatchPosition(position.task_id, position.handout, position.records_end, records)
        self.keys += keys

    def mean(self) -> dict:
        out = {}
        for name, value in self.grads[0].items():
            if isinstance(value, IndexedRows):
                ids = np.concatenate([g[name].ids for g in self.grads])
                rows = np.concatenate([g[name].values for g in self.grads]) / len(self.grads)
                out[name] = IndexedRows(ids, rows.astype(np.float32)).deduplicated()
            else:
                out[name] = sum(g[name] for g in self.grads) / len(self.grads)
        return out


class SimWorker:
    def __init__(self, index: int, mode: Mode, data: Dataset, names: list[str],
                 validation: Dataset | None = None) -> None:
        self.index = index
        self.mode = mode
        self.data = data
        self.validation = validation
        self.num_ps = mode.num_ps
        self.model = LinearModel(names, mode.embedding)
        self.policy = ConsistencyPolicy(
            use_async=mode.use_async, staleness_bound=mode.staleness_bound, get_model_steps=mode.get_model_steps,
            num_ps=mode.num_ps, push_steps=mode.push_steps, overlap=mode.overlap,
        )
        self.built = False
        self.stop_requested = False
        self.progress = 0
        self.acc = Accumulated()
        self.exchange = None  # overlap: (futures, request, parts, versions, position, keys)
        self.now = lambda: 0.0  # set by the world: the simulated clock
        self.probed_at = 0.0  # the last look for an empty PS while waiting for a task (from the start)

    # ------------------------------------------------------------ the task loop

    def run(self):
        self.probed_at = self.now()
        while not self.stop_requested:
            order = yield from self._master("get_task", self.index)
            if order is NoTask.END:
                return
            if order is NoTask.WAIT:
                yield Sleep(WAIT_SECONDS)
                if self.built and self.now() - self.probed_at >= REFILL_PROBE_SECONDS:
                    self.probed_at = self.now()  # batch_loop._refill_while_waiting
                    yield from self._with_ps_retries(self._refill_while_waiting)
                continue
            if order.type is TaskType.EVALUATION:
                yield from self.evaluate_task(order)
                continue
            self.progress = 0
            self.policy.task_started()
            try:
                records, interrupted = yield from self.train_task(order)
            except TaskTakenBackError:
                continue
            except (PushRejectedError, RuntimeError, Unavailable) as err:
                yield from self._master("report", (order.task_id, self.index, f"{type(err).__name__}: {err}",
                                                   self.progress, False, order.handout))
                continue
            yield from self._master("report", (order.task_id, self.index, "", records, interrupted, order.handout))

    def train_task(self, order):
        start, end = order.shard.start, order.shard.end
        interrupted = False
        try:
            done = 0
            while done < end - start:
                indices = list(range(start + done, min(end, start + done + MINIBATCH)))
                position = BatchPosition(order.task_id, order.handout, start + done + len(indices), len(indices))
                keys = [(order.epoch, i) for i in indices]
                yield from self.train_batch(indices, position, keys)
                done += len(indices)
                self.progress = done
                self._master_async("progress", (order.task_id, self.index, done))
                if self.stop_requested and done < end - start:
                    interrupted = True
                    break
            yield from self._with_ps_retries(self._settle_exchange)
            yield from self._with_ps_retries(self._push_accumulated)
        except GeneratorExit:
            raise  # killed: nothing more runs
        except BaseException:
            yield from self._drop_exchange()
            if self.acc.grads:
                self.acc = Accumulated()
                self.policy.accumulation_dropped()
            raise
        return (self.progress if interrupted else end - start), interrupted

    def evaluate_task(self, order):
        """worker.evaluate_task: the round's snapshot from every PS, the metrics' states reported;
        a snapshot gone with a PS hands the task back whole (interrupted, 0 records)."""
        metrics = MetricsAccumulator(eval_metrics())
        indices = list(range(order.shard.start, order.shard.end))
        ids = list(range(EMBEDDING_IDS)) if self.model.embedding else []
        try:
            if not self.built:
                yield from self._initialize_ps()
                self.built = True
            for ps in range(self.num_ps):
                pulled = yield Call(f"ps-{ps}", "pull_snapshot", (order.snapshot_id, ids))
                if pulled is None:
                    raise Unavailable(f"ps-{ps} holds no snapshot {order.snapshot_id}")
                self.model.set_params(pulled[1])
                self.model.rows.update(pulled[2])
            self.policy.snapshot_loaded()  # the next training batch pulls first
        except Unavailable:
            yield Sleep(WAIT_SECONDS)
            yield from self._master("report", (order.task_id, self.index, "", 0, True, 0, None))
            return
        metrics.update(self.validation.targets[indices], self.model.predict(self.validation, indices))
        yield from self._master("report", (order.task_id, self.index, "", len(indices), False, 0, metrics.states()))

    # ------------------------------------------------------------ one batch

    def train_batch(self, indices, position, keys):
        if self.policy.overlap:
            yield from self._train_batch_overlapped(indices, position, keys)
        elif not self.policy.accumulates:
            yield from self._with_ps_retries(lambda: self._train_batch_once(indices, position, keys))
        else:
            yield from self._with_ps_retries(lambda: self._accumulate_batch(indices, position, keys))
            if self.policy.push_due():
                yield from self._with_ps_retries(self._push_accumulated)

    def _with_ps_retries(self, call):
        deadline, pause = self.now() + PS_RECONNECT_SECONDS, 0.2
        while True:
            try:
                return (yield from call())
            except Unavailable:
                if self.now() > deadline:
                    raise
                yield Sleep(pause)
                pause = min(pause * 2, 2.0)
                self.policy.ps_reconnected()  # it may come back older or empty: pull everything

    def _before_batch(self):
        if not self.built:
            yield from self._initialize_ps()
            self.built = True
        if self.policy.bounded:
            yield from self._wait_within_staleness_bound()

    def _compute(self, indices):
        yield Sleep(COMPUTE_SECONDS)
        return self.model.gradients(self.data, indices)

    def _train_batch_once(self, indices, position, keys):
        yield from self._before_batch()
        policy = self.policy
        pending = set(range(self.num_ps))
        for _ in range(MAX_PUSH_TRIES):
            if policy.must_pull():
                yield from self._pull()
            _, grads = yield from self._compute(indices)
            parts = split(grads, self.num_ps)
            answers = yield from self._push({ps: parts[ps] for ps in pending}, policy.versions,
                                            policy.wants_push_parameters, position, keys)
            pending = policy.push_answered(answers)
            for answer in answers.values():
                if answer.params is not None:
                    self.model.set_params(answer.params)
            if not pending:
                policy.batch_pushed()
                if policy.applies_locally:
                    self.model.apply_locally(grads)
                return

    def _accumulate_batch(self, indices, position, keys):
        yield from self._before_batch()
        if self.policy.must_pull():
            yield from self._pull()
        _, grads = yield from self._compute(indices)
        self.acc.add(grads, position, keys)
        self.model.apply_locally(grads)
        self.policy.batch_accumulated()

    def _push_accumulated(self):
        if not self.acc.grads:
            return
        policy = self.policy
        parts = split(self.acc.mean(), self.num_ps)
        pending = set(range(self.num_ps))
        for _ in range(MAX_PUSH_TRIES):
            if policy.must_pull_before_push():  # after a reconnect: versions -1 are refused
                yield from self._pull()
            answers = yield from self._push({ps: parts[ps] for ps in pending}, policy.versions, False,
                                            self.acc.position, self.acc.keys)
            pending = policy.push_answered(answers)
            if not pending:
                break
        self.acc = Accumulated()
        policy.accumulation_pushed()

    def _train_batch_overlapped(self, indices, position, keys):
        policy = self.policy
        state = {}

        def compute():
            yield from self._before_batch()
            if policy.must_pull():
                yield from self._pull()
            state["versions"] = policy.versions
            state["grads"] = (yield from self._compute(indices))[1]

        yield from self._with_ps_retries(compute)
        parts = split(state["grads"], self.num_ps)
        yield from self._with_ps_retries(self._settle_exchange)
        if policy.applies_locally:
            self.model.apply_locally(state["grads"])
        request = policy.pull_request() if policy.pulls_after_push() else None
        futures = self._start_push(dict(enumerate(parts)), state["versions"], False, position, keys)
        self.exchange = (futures, request, parts, state["versions"], position, keys)
        policy.exchange_started()

    def _settle_exchange(self):
        if self.exchange is None:
            return
        futures, request, parts, versions, position, keys = self.exchange
        self.exchange = None
        policy = self.policy
        try:
            if futures is None:  # its push failed (a PS was away): pushed again, after a pull if due
                if policy.must_pull_before_push():
                    yield from self._pull()
                    versions = policy.versions
                futures = self._start_push(dict(enumerate(parts)), versions, False, position, keys)
            answers = yield from self._answers(futures)
        except Unavailable:  # pushed again on the retry, as the real exchange's error is raised here
            self.exchange = (None, request, parts, versions, position, keys)
            raise
        try:
            pending = policy.push_answered(answers)
        except BaseException:
            policy.exchange_dropped()
            raise
        policy.exchange_settled()
        for _ in range(MAX_PUSH_TRIES):
            if not pending:
                break
            answers = yield from self._push({ps: parts[ps] for ps in pending}, versions, False, position, keys)
            pending = policy.push_answered(answers)
        if pending:
            return
        policy.batch_pushed()
        if request is None:
            return
        if request.versions != tuple(policy.versions):
            yield from self._pull()
        else:
            yield from self._pull_with(request)

    def _drop_exchange(self):
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        try:
            if exchange[0] is not None:  # None: its push failed, nothing is in flight
                yield from self._answers(exchange[0])
        except Unavailable:
            pass
        self.policy.exchange_dropped()

    # ------------------------------------------------------------ SSP

    def _wait_within_staleness_bound(self):
        blocked, pause = 0.0, 0.005
        while True:
            clock, slowest = yield from self._master("report_clock", (self.index, self.policy.clock, blocked))
            if not self.policy.must_wait(clock, slowest):
                return
            if self.exchange is not None:
                yield from self._with_ps_retries(self._settle_exchange)
                blocked = 0.0
                continue
            self.policy.held_back()
            yield Sleep(pause)
            blocked, pause = pause, min(pause * 2, 0.2)

    # ------------------------------------------------------------ PS calls

    def _initialize_ps(self):
        pulled = yield from self._pull_all([-1] * self.num_ps)
        if not all(p[0] for p in pulled):  # at the others' version, as batch_loop's _initialize_ps
            version = max((p[1] for p in pulled if p[0]), default=0)
            yield from self._each("push_model", [(dict(self.model.params), version)] * self.num_ps)
        if self.model.embedding:
            yield from self._each("push_table_infos", [(self.model.table_infos,)] * self.num_ps)
        yield from self._pull(everything=True)

    def _pull(self, everything: bool = False):
        yield from self._pull_with(self.policy.pull_request(everything))

    def _pull_with(self, request):
        results = []
        for ps, (version, wait) in enumerate(zip(request.versions, request.wait_for_newer)):
            deadline = self.now() + SYNC_WAIT_SECONDS
            while True:  # a waiting pull polls, as rpc/ps_client.py's _pull_newer does
                result = yield Call(f"ps-{ps}", "pull", (version, self._ids()))
                if not wait or result[1] != version or self.now() > deadline:
                    break
                yield Sleep(0.01)
            results.append(result)
        if (yield from self._refill_empty(results)):
            results = yield from self._pull_all(list(request.versions))
        for ps, result in enumerate(results):
            if not result[0]:
                raise RuntimeError(f"PS {ps} has no model")
        for _, _, params, rows in results:
            self.model.set_params(params)
            self.model.rows.update(rows)
        self.policy.pulled(request, [r[1] for r in results])

    def _refill_empty(self, results):
        """batch_loop._refill_empty: a PS relaunched without a checkpoint gets our copy of its
        variables, at the version the other shards are at; True if one did."""
        if all(r[0] for r in results) or not self.built:
            return False
        version = max((r[1] for r in results if r[0]), default=0)
        yield from self._each("push_model", [(dict(self.model.params), version)] * self.num_ps)
        if self.model.embedding:
            yield from self._each("push_table_infos", [(self.model.table_infos,)] * self.num_ps)
        return True

    def _refill_while_waiting(self):
        """batch_loop._refill_while_waiting: no task now; a PS that holds no model is refilled
        (the policy is not told)."""
        yield from self._refill_empty((yield from self._pull_all(self.policy.versions)))

    def _pull_all(self, versions):
        return (yield from self._each("pull", [(v, self._ids()) for v in versions]))

    def _ids(self):
        return list(range(5)) if self.model.embedding else []

    def _push(self, parts: dict, versions, want_params: bool, position, keys):
        return (yield from self._answers(self._start_push(parts, versions, want_params, position, keys)))

    def _start_push(self, parts: dict, versions, want_params: bool, position, keys) -> dict:
        futures = {}
        for ps, grads in parts.items():
            call = Call(f"ps-{ps}", "push", (grads, versions[ps], want_params, position, tuple(keys)), blocking=False)
            futures[ps] = self._started(call)
        return futures

    def _answers(self, futures: dict):
        answers, error = {}, None
        for ps, future in futures.items():
            try:
                answers[ps] = yield Await(future)
            except Unavailable as err:
                error = error or err
        if error is not None:
            raise error
        return answers

    def _each(self, method: str, args: list):
        futures = {ps: self._started(Call(f"ps-{ps}", method, a, blocking=False)) for ps, a in enumerate(args)}
        results = yield from self._answers(futures)
        return [results[ps] for ps in range(len(args))]

    def _started(self, call):
        return self.send(call)

    # ------------------------------------------------------------ the master

    def _master(self, method: str, args):
        args = args if isinstance(args, tuple) else (args,)
        while True:  # the master may be restarting: ask again
            try:
                return (yield Call("master", method, args))
            except Unavailable:
                yield Sleep(0.1)

    def _master_async(self, method: str, args) -> None:
        self.send(Call("master", method, args, blocking=False))
