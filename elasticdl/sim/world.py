"""One simulated job: the roles, the backend that starts and kills them, the state store,
the checkpoint directory, and the loop that runs it to its end under the nemesis.

``World(seed).run()`` returns a ``RunResult``: the mode, the faults injected and every
invariant violated. Everything it does follows from the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from elasticdl import fs
from elasticdl.launch.api import ProcessExit
from elasticdl.master import controller as c
from elasticdl.master.ps_losses import SHARD_LOST
from elasticdl.sim import invariants
from elasticdl.sim.faults import Nemesis
from elasticdl.sim.master import SimMaster
from elasticdl.sim.model import Dataset, variable_names
from elasticdl.sim.modes import Mode
from elasticdl.sim.oracle import Oracle
from elasticdl.sim.ps import SimPS, settings_for
from elasticdl.sim.replicas import ReplicaLedger
from elasticdl.sim.scheduler import Process, Scheduler
from elasticdl.sim.stream import SimTopic
from elasticdl.sim.transport import Network
from elasticdl.sim.worker import SimWorker
from elasticdl.store.errors import RetryPolicy
from elasticdl.store.memory import MemoryBackend

# Once the nemesis stops, the job must end within this much simulated time: a requeue after
# the task timeout, a few relaunches, the epochs left (a job here trains for a few seconds).
PROGRESS_BOUND = 60.0
EVALUATION_SHARE = 0.4  # of the seeds run an evaluation at each epoch's end (and every 3 versions, some)
MAX_STEPS = 400_000


@dataclass
class RunResult:
    seed: int
    mode: Mode
    faults: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    outcome: str = ""
    steps: int = 0
    sim_seconds: float = 0.0


class World:
    def __init__(self, seed: int, family: str | None = None, faults: bool = True) -> None:
        self.seed = seed
        self.scheduler = Scheduler(seed)
        self.rng = self.scheduler.rng
        self.clock = self.scheduler.clock
        self.mode = Mode.pick(self.rng, family)
        self.records = self.rng.choice((8, 12, 16))
        self.epochs = self.rng.randint(1, 3)
        self.names = variable_names(self.mode.num_ps)
        self.data = Dataset.generate(self.rng, self.records, len(self.names))
        self.topic: SimTopic | None = None  # --mode stream: the broker the records arrive in
        if self.mode.stream:  # no epochs: every record once, as it arrives
            self.records, self.epochs = self.rng.choice((12, 20, 28)), 1
            self.data = Dataset.generate(self.rng, self.records, len(self.names))
            self.topic = SimTopic.generate(self.clock, self.rng, self.records)
        # Evaluation from a generator of its own (derived from the seed): the schedules of seeds
        # without it stay as they were before evaluation was simulated.
        evaluation = random.Random(f"{seed}-evaluation")
        self.validation: Dataset | None = None
        self.val_records, self.evaluation_steps = 0, 0
        if evaluation.random() < EVALUATION_SHARE and not self.mode.stream:
            self.val_records = evaluation.choice((4, 6))
            self.evaluation_steps = evaluation.choice((0, 3))
            self.validation = Dataset.generate(evaluation, self.val_records, len(self.names))
            self.validation.path = "sim://validation"
        self.network = Network(self.scheduler)
        self.oracle = Oracle(self.mode.num_ps, now=self.clock)
        self.replica_ledger = ReplicaLedger()  # --ps_replicas: each primary's states, what it acknowledged
        self.rollbacks = 0  # PS relaunches that went back to a cut or started over (not a spare's)
        self.masters_started = 0
        self.checkpoint_dir = f"memory://elasticdl-sim/{seed}/ckpt" if self.mode.checkpoints else ""
        self.no_retry = RetryPolicy(budget=0.0)
        self.store_backend = MemoryBackend(clock=self.clock)
        self.store_cut = False
        self.term = 0
        self.ps: list[SimPS | None] = [None] * self.mode.num_ps
        self.workers: dict[int, tuple[SimWorker, Process]] = {}
        self.exits: list[ProcessExit] = []
        self.master: SimMaster | None = None
        self.master_process: Process | None = None
        self.outcome: c.Finish | c.Fail | None = None
        self.result = RunResult(seed, self.mode)
        self.nemesis = Nemesis(self, enabled=faults)

    # ------------------------------------------------------------ running

    def run(self) -> RunResult:
        if self.checkpoint_dir:
            fs.rmtree(self.checkpoint_dir)
        try:
            self.start_master()
            self.nemesis.schedule()
            while self.outcome is None and not self.result.violations:
                if not self.scheduler.step():
                    self.violation("the simulation ran out of events before the job ended")
                    break
                if self.clock() > self.nemesis.end + PROGRESS_BOUND or self.scheduler.steps > MAX_STEPS:
                    self.violation(f"no progress: the job did not end within {PROGRESS_BOUND:g}s of the last fault "
                                   f"(epoch {self.master.tasks.epoch + 1} of {self.epochs}, todo/doing "
                                   f"{self.master.tasks.counts()})")
                    break
            self.result.violations += self.oracle.violations
        except Exception as err:  # noqa: BLE001  a crash of the real code or of the simulator is a finding
            self.violation(f"crashed: {type(err).__name__}: {err}")
        finally:
            if self.checkpoint_dir:
                fs.rmtree(self.checkpoint_dir)
        self.result.steps = self.scheduler.steps
        self.result.sim_seconds = round(self.clock(), 3)
        return self.result

    def violation(self, message: str) -> None:
        self.result.violations.append(f"t={self.clock():.3f}s: {message}")

    # ------------------------------------------------------------ the master

    def start_master(self) -> None:
        """A master process; it serves and acts once it holds the leader lock (etcd-like store)."""
        self.masters_started += 1
        self.master = SimMaster(self, self.term + 1)
        self.master_process = Process(self.scheduler, self.master.run(), self.network.send, self._master_exited)
        self.master.process = self.master_process

    def _master_exited(self, returncode: int, tail: str) -> None:
        if returncode != 0 and self.master is not None and self.master.alive:
            self.violation(f"the master crashed: {tail}")

    def kill_master(self) -> None:
        """SIGKILL of the master: its children go with it; a supervisor starts a new one, which
        resumes from the store once the old lease expired."""
        self.master.alive = False
        self.master_process.kill()
        self._children_gone()
        self.scheduler.at(self.rng.uniform(0.1, 1.0), self.start_master)

    def master_stopped(self, master: SimMaster) -> None:
        """It lost the leader lock and exits 1; the supervisor starts another."""
        master.alive = False
        if master is self.master:
            self._children_gone()
            self.scheduler.at(self.rng.uniform(0.1, 1.0), self.start_master)

    def took_over(self, master: SimMaster) -> None:
        """``master`` holds the lock: an older one's roles are gone (a partitioned master's too).
        Of two masters waiting for the lock, the one that takes it is the job's master."""
        self.term = master.term
        self.master, self.master_process = master, master.process
        self._children_gone()

    def _children_gone(self) -> None:
        for index in list(self.workers):
            self.kill_worker(index, report=False)
        for ps in self.ps:
            if ps is not None and ps.alive:
                ps.alive = False
                for shard in ps.led():
                    self.oracle.lost_pending(shard)
        self.exits.clear()

    def is_leader(self, master: SimMaster) -> bool:
        return master is self.master and master.alive

    def acted(self, master: SimMaster) -> None:
        """At most one master acts: the newest, and (etcd-like store) only while it holds the lock."""
        holds = master.leadership is None or master.leadership.holds()
        if master is not self.master or not master.alive or not holds:
            self.violation(f"two leaders: the master of term {master.term} acted while the lock "
                           f"{'is held by term ' + str(self.term) if master is not self.master else 'is not its own'}")

    def livelock(self, message: str) -> None:
        self.violation(f"livelock: {message}")

    def job_ended(self, master: SimMaster, outcome) -> None:
        self.outcome = outcome
        if isinstance(outcome, c.Fail):
            if not self.checkpoint_dir and SHARD_LOST in outcome.error:
                self.result.outcome = "failed: a shard lost without a checkpoint"  # the documented outcome
                return
            self.violation(f"the job failed: {outcome.error.splitlines()[0]}")
            return
        self.result.outcome = "finished"
        invariants.at_the_end(self)
        for index in list(self.workers):
            self.kill_worker(index, report=False)

    # ------------------------------------------------------------ the backend

    def start_ps(self, ps_id: int, restore_from: str, fence: int, delay: float | None = None,
                 moved_to: tuple[tuple[int, int], ...] = ()) -> None:
        """``moved_to`` (--ps_replicas): a spare, serving none of the shards it led (promoted elsewhere)."""
        ps = SimPS(ps_id, settings_for(self.mode, ps_id, self.checkpoint_dir, self.term, restore_from, fence),
                   self.oracle, self, self.mode.ps_replicas, moved_to)
        old, self.ps[ps_id] = self.ps[ps_id], ps
        if not moved_to and old is not None:
            self.rollbacks += 1
        if old is not None and not restore_from and not moved_to:
            self.oracle.emptied(ps_id)
        self.network.endpoints[f"ps-{ps_id}"] = ps
        if delay == 0.0:
            ps.start()
        else:
            self.scheduler.at(self.rng.uniform(0.05, 0.3) if delay is None else delay, lambda: self._boot(ps))

    def _boot(self, ps: SimPS) -> None:
        if self.ps[ps.ps_id] is not ps:
            return
        try:
            ps.start()
        except Exception as err:  # noqa: BLE001  the PS exits non-zero; the master sees it
            self.exits.append(ProcessExit("ps", ps.ps_id, 1, f"{type(err).__name__}: {err}"))

    def ps_list(self) -> list[SimPS]:
        return list(self.ps)

    def kill_ps(self, ps_id: int) -> None:
        ps = self.ps[ps_id]
        if not ps.alive:
            return
        ps.alive = False
        self.network.killed(f"ps-{ps_id}")
        for shard in ps.led():
            self.oracle.lost_pending(shard)
        self.exits.append(ProcessExit("ps", ps_id, -9, ""))

    def start_worker(self, index: int) -> None:
        worker = SimWorker(index, self.mode, self.data, self.names, self.validation, self.topic)
        worker.now, worker.send = self.clock, self.network.send

        def exited(returncode: int, tail: str) -> None:
            if self.workers.get(index, (None, None))[0] is worker:
                del self.workers[index]
                self.exits.append(ProcessExit("worker", index, returncode, tail))

        self.workers[index] = (worker, Process(self.scheduler, worker.run(), self.network.send, exited))

    def kill_worker(self, index: int, report: bool = True) -> None:
        worker = self.workers.pop(index, None)
        if worker is None:
            return
        worker[1].kill()
        if report:
            self.exits.append(ProcessExit("worker", index, -9, ""))

    def request_stop(self, index: int) -> None:
        if index in self.workers:
            self.workers[index][0].stop_requested = True

    def poll_exits(self) -> list[ProcessExit]:
        exits, self.exits = self.exits, []
        return exits

    def oracle_emptied_all(self) -> None:
        for ps_id in range(self.mode.num_ps):
            self.oracle.emptied(ps_id)
