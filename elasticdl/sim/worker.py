"""A simulated worker: the real worker's batch loop as a coroutine, on the real ConsistencyPolicy.

It mirrors elasticdl/worker/worker.py and batch_loop.py: get a task, and for each batch carry
out the steps ``ConsistencyPolicy.next_step()`` returns (wait, settle, pull, compute, push:
the real step sequence of every mode, elasticdl/worker/batch_steps.py), telling the policy
what happened, then flush the task (``task_ending``) and report; a failed task is left
(``task_left``). The model is the numpy stand-in (sim/model.py). The calls go through the
simulated network; a PS that does not answer is retried as ``BatchLoop._run_steps`` does,
telling the policy ``ps_reconnected()``. An overlapped exchange's pull is made when it is
settled. Each push also carries the keys of its records, for the simulator's oracle only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elasticdl.master.task_manager import NoTask, TaskType
from elasticdl.model.embedding.table import IndexedRows
from elasticdl.model.metrics import MetricsAccumulator
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.replica_commands import ROUTES_SECONDS, Routes, claimed_routes
from elasticdl.sim.model import EMBEDDING_IDS, Dataset, LinearModel, eval_metrics, split
from elasticdl.sim.modes import Mode
from elasticdl.sim.scheduler import Await, Sleep
from elasticdl.sim.transport import Call, Unavailable
from elasticdl.worker.batch_loop import REFILL_PROBE_SECONDS
from elasticdl.worker.consistency import ConsistencyPolicy, PushRejectedError, TaskTakenBackError
from elasticdl.worker.steps import Gradients, StepKind

PS_RECONNECT_SECONDS = 120.0
SYNC_WAIT_SECONDS = 30.0
MINIBATCH = 2
WAIT_SECONDS = 0.05  # a worker told WAIT asks again after this long
COMPUTE_SECONDS = 0.003


@dataclass
class Exchange:
    """overlap: a batch's push in flight (``futures``; None: to be made again) and whether the
    pull after it is due (prepared when it is settled, as Exchange's prepare on a retry)."""

    futures: dict | None
    pulls: bool


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
                 validation: Dataset | None = None, topic=None) -> None:
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
        self.exchange: Exchange | None = None  # overlap: the push in flight
        self.outbox = None  # (parts, versions, position, keys, grads) until every PS took them
        self.grads = None  # the last COMPUTE's, until a PUSH takes them
        self.batch = None  # (indices, position, keys) of the batch under way
        self.pause = self.blocked = 0.0  # SSP: the next pause, and the time blocked not reported yet
        self.now = lambda: 0.0  # set by the world: the simulated clock
        self.probed_at = 0.0  # the last look for an empty PS while waiting for a task (from the start)
        self.routes = Routes.initial(mode.num_ps) if mode.ps_replicas else None  # --ps_replicas
        self.topic = topic  # --mode stream: a task's offsets are records of a partition

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
                if self.topic is not None:  # offsets of a partition: the job's records they hold
                    indices = self.topic.records_at(order.shard.path, indices)
                keys = [(order.epoch, i) for i in indices]
                yield from self.train_batch(indices, position, keys)
                done += len(indices)
                self.progress = done
                self._master_async("progress", (order.task_id, self.index, done))
                if self.stop_requested and done < end - start:
                    interrupted = True
                    break
            self.policy.task_ending()  # BatchLoop._finish_task_pushes: settle, push what is accumulated
            yield from self._run_steps()
        except GeneratorExit:
            raise  # killed: nothing more runs
        except BaseException:
            yield from self._leave_task()
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
                pulled = yield self._ps_call(ps, "pull_snapshot", (order.snapshot_id, ids))
                if pulled is None:
                    raise Unavailable(f"ps-{ps} holds no snapshot {order.snapshot_id}")
                self.model.set_params(pulled[1])
                self.model.rows.update(pulled[2])
            self.policy.snapshot_loaded()  # the next training batch pulls first
        except Unavailable:
            yield from self._refresh_routes()
            yield Sleep(WAIT_SECONDS)
            yield from self._master("report", (order.task_id, self.index, "", 0, True, 0, None))
            return
        metrics.update(self.validation.targets[indices], self.model.predict(self.validation, indices))
        yield from self._master("report", (order.task_id, self.index, "", len(indices), False, 0, metrics.states()))

    # ------------------------------------------------------------ one batch (BatchLoop)

    def train_batch(self, indices, position, keys):
        """BatchLoop.train_batch: the steps ConsistencyPolicy.next_step() returns, carried out."""
        yield from self._with_ps_retries(self._before_batch)
        self.batch, self.pause = (indices, position, keys), 0.005
        self.policy.batch_started()
        yield from self._run_steps()

    def _run_steps(self):
        """BatchLoop._run_steps, with its one retry rule (_ps_unreachable)."""
        policy, deadline, pause = self.policy, None, 0.2
        while (step := policy.next_step()).kind is not StepKind.DONE:
            try:
                yield from self._step(step)
                deadline = None
            except Unavailable:
                if deadline is None:
                    deadline, pause = self.now() + PS_RECONNECT_SECONDS, 0.2
                if self.now() > deadline:
                    raise
                yield from self._refresh_routes()
                yield Sleep(pause)
                pause = min(pause * 2, 2.0)
                policy.ps_reconnected()  # it may come back older or empty: pull everything

    def _with_ps_retries(self, call):
        deadline, pause = self.now() + PS_RECONNECT_SECONDS, 0.2
        while True:
            try:
                return (yield from call())
            except Unavailable:
                if self.now() > deadline:
                    raise
                yield from self._refresh_routes()
                yield Sleep(pause)
                pause = min(pause * 2, 2.0)
                self.policy.ps_reconnected()

    def _before_batch(self):
        if not self.built:
            yield from self._initialize_ps()
            self.built = True

    def _step(self, step):
        kind = step.kind
        if kind is StepKind.WAIT:
            yield from self._wait_step()
        elif kind is StepKind.SETTLE:
            yield from self._settle_exchange()
        elif kind is StepKind.PULL:
            yield from self._pull_with(step.pull)
        elif kind is StepKind.COMPUTE:
            yield from self._compute_step(step)
        else:
            yield from self._push_step(step)

    def _wait_step(self):
        """SSP: report the clock; while too far ahead of the slowest worker, pause."""
        clock, slowest = yield from self._master("report_clock", (self.index, self.policy.clock, self.blocked))
        self.blocked = 0.0
        if self.policy.clock_reported(clock, slowest) and not self.policy.in_flight:
            yield Sleep(self.pause)
            self.blocked, self.pause = self.pause, min(self.pause * 2, 0.2)

    def _compute_step(self, step):
        indices, position, keys = self.batch
        yield Sleep(COMPUTE_SECONDS)
        _, grads = self.model.gradients(self.data, indices)
        if step.keep:  # --push_steps: applied to the local copy, pushed with the next ones
            self.acc.add(grads, position, keys)
            self.model.apply_locally(grads)
        else:
            self.grads = grads
        self.policy.computed(True)

    def _push_step(self, step):
        policy = self.policy
        if step.gradients is not Gradients.AGAIN:
            if step.gradients is Gradients.ACCUMULATED:
                grads, position, keys = self.acc.mean(), self.acc.position, list(self.acc.keys)
            else:
                grads, self.grads = self.grads, None
                _, position, keys = self.batch
            self.outbox = (split(grads, self.num_ps), step.versions, position, keys, grads)
        parts, versions, position, keys, grads = self.outbox
        if step.background:  # overlap: the next batch computes on our own copy of this update
            self.model.apply_locally(grads)
            self.exchange = Exchange(self._start_push(dict(enumerate(parts)), versions, False, position, keys),
                                     step.pull is not None)
            policy.started_in_background(step)
            return
        answers = yield from self._push({ps: parts[ps] for ps in step.to_ps}, step.versions, step.want_parameters,
                                        position, keys)
        for answer in answers.values():
            if answer.params is not None:
                self.model.set_params(answer.params)
        dropped = policy.dropped
        taken = policy.pushed(answers, step)  # raises TaskTakenBackError, PushRejectedError
        if policy.unpushed == 0 and self.acc.grads:
            self.acc = Accumulated()
        if taken is not None or policy.dropped != dropped:
            self.outbox = None
        if taken is Gradients.BATCH and step.apply_locally:
            self.model.apply_locally(grads)

    # ------------------------------------------------------------ overlap: the exchange

    def _settle_exchange(self):
        """BatchLoop._settle_exchange. A push that found a PS away is made again here (freshly
        prepared: Exchange.result after an error), the same batch position: taken once."""
        exchange = self.exchange
        if exchange is None:
            return
        parts, versions, position, keys, _ = self.outbox
        futures, exchange.futures = exchange.futures, None
        if futures is None:
            futures = self._start_push(dict(enumerate(parts)), versions, False, position, keys)
        answers = yield from self._answers(futures)  # Unavailable: the retry settles it again
        request = self.policy.pull_request() if exchange.pulls else None
        self.exchange = None
        if not self.policy.settled(answers):  # raises TaskTakenBackError, PushRejectedError
            return  # some PS refused it as stale: the next step pushes it again
        self.outbox = None
        if request is not None:
            yield from self._pull_with(request)

    def _leave_task(self):
        """BatchLoop._leave_task: no push lands after the report; what was not pushed is dropped."""
        exchange, self.exchange = self.exchange, None
        if exchange is not None and exchange.futures is not None:
            try:
                yield from self._answers(exchange.futures)
            except Unavailable:
                pass
        self.acc = Accumulated()
        self.outbox = None
        self.policy.task_left()

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
                result = yield self._ps_call(ps, "pull", (version, self._ids()))
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
            call = self._ps_call(ps, "push", (grads, versions[ps], want_params, position, tuple(keys)), blocking=False)
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
        futures = {ps: self._started(self._ps_call(ps, method, a, blocking=False)) for ps, a in enumerate(args)}
        results = yield from self._answers(futures)
        return [results[ps] for ps in range(len(args))]

    def _ps_call(self, shard: int, method: str, args: tuple, blocking: bool = True) -> Call:
        """A call for ``shard``, to the PS of its primary (--ps_replicas: the routes last heard)."""
        if self.routes is None:
            return Call(f"ps-{shard}", method, args, blocking=blocking)
        return Call(f"ps-{self.routes.primary[shard]}", method, args, blocking=blocking, shard=shard)

    def _refresh_routes(self):
        """PSClient.refresh_routes: after a PS call failed, the routes every PS that answers
        tells, merged by elasticdl/rpc/replica_commands.py's rule."""
        if self.routes is None:
            return
        tables = {}
        for ps in range(self.num_ps):
            try:
                tables[ps] = yield Call(f"ps-{ps}", "routes", (), timeout=ROUTES_SECONDS)
            except Unavailable:
                continue
        self.routes = claimed_routes(tables) or self.routes

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
