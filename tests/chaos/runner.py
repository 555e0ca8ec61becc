"""Run one seed: start its job, fire its faults on their events, undo the holds, and see how it ends.

A master that exits non-zero with etcd behind it is started again (as Kubernetes would restart
its pod) when the nemesis caused it: it was SIGKILLed, or it lost its leader lock to a store cut
or a long SIGSTOP. That is the recovery the design promises; the restarted master must resume
and end the job with the same counts. Without etcd a restarted master starts over, so nothing
restarts it and its failure is the run's outcome.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field

from elasticdl.model.checkpoint import complete_versions
from tests.chaos.job import ChaosJob
from tests.chaos.modes import Plan
from tests.chaos.schedule import Fault
from tests.test_e2e_local import _alive

POLL = 0.2
MAX_MASTER_RESTARTS = 3
STALL = 90.0


@dataclass
class Outcome:
    returncode: int | None  # the last master's exit code; None: the run passed its deadline (a hang)
    injected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # faults whose event never came (the job ended first)
    master_restarts: int = 0
    seconds: float = 0.0
    orphans: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    master_log_tail: str = ""
    damaged: list[str] = field(default_factory=list)  # checkpoint shard files the nemesis damaged
    ps_kills: int = 0  # PS the nemesis SIGKILLed: deaths beyond these are the job's own


@dataclass
class StallWatch:
    """A stalled job is a hang well before the deadline: nothing it shows (cuts, master log lines)
    changed for ``limit`` s while no fault is held (a sync job writes a cut every few seconds)."""

    limit: float
    seen: tuple = ()
    since: float = 0.0

    def stalled(self, seen: tuple, now: float, held: bool) -> bool:
        if seen != self.seen or held:
            self.seen, self.since = seen, now
            return False
        return now - self.since > self.limit


@dataclass
class _Hold:
    fault: Fault
    undo: object  # () -> None
    cuts_at: float
    until: float
    gone: object = None  # () -> bool: the hold lasts until it holds (freeze_worker: the process was replaced)


class Nemesis:
    """Fires ``faults`` in order at ``job``, each on its event after the one before."""

    def __init__(self, job: ChaosJob, faults: list[Fault], clock=time.monotonic):
        self.job = job
        self.pending = list(faults)
        self.holds: list[_Hold] = []
        self.clock = clock
        self.base = job.events.count("cut"), 0  # (events of the next fault's kind) at the last fault
        self.outcome = Outcome(returncode=None)
        self.master_killed = False
        self._mark()

    def _mark(self) -> None:
        if self.pending:
            self.base = self.job.events.count(self.pending[0].trigger), 0

    def step(self) -> None:
        """Fire the next fault if its event came; undo the holds whose event or time came."""
        now = self.clock()
        for hold in list(self.holds):
            if hold.gone is not None:
                if hold.gone():
                    self.holds.remove(hold)
                continue
            if self.job.events.count("cut") > hold.cuts_at or now >= hold.until:
                self.holds.remove(hold)
                self._undo(hold)
        if self.pending:
            fault = self.pending[0]
            if self.job.events.count(fault.trigger) - self.base[0] >= fault.count:
                self.pending.pop(0)
                try:
                    self._fire(fault)
                except (OSError, RuntimeError) as err:  # e.g. the cut it damages pruned meanwhile
                    self.outcome.skipped.append(fault.describe())
                    self.outcome.notes.append(f"nemesis: {fault.describe()} could not be done: {err}")
                self._mark()

    def release_all(self) -> None:
        for hold in self.holds:
            self._undo(hold)
        self.holds = []

    def _undo(self, hold: _Hold) -> None:
        try:
            hold.undo()
        except (OSError, RuntimeError) as err:  # etcd that does not come back is the harness's failure
            self.outcome.notes.append(f"nemesis: undoing {hold.fault.describe()} failed: {err}")

    def _hold(self, fault: Fault, undo) -> None:
        self.holds.append(_Hold(fault, undo, self.job.events.count("cut"), self.clock() + fault.hold_seconds))

    def _fire(self, fault: Fault) -> None:
        job, done = self.job, True
        if fault.action == "kill_ps":
            done = job.signal_role("ps", fault.target, signal.SIGKILL) is not None
            self.outcome.ps_kills += done
        elif fault.action == "kill_worker":
            done = job.signal_role("worker", fault.target, signal.SIGKILL) is not None
        elif fault.action in ("stop_ps", "stop_worker", "stop_master"):
            role = fault.action.split("_")[1]
            pid = job.signal_role(role, fault.target, signal.SIGSTOP)
            done = pid is not None
            if done:
                self._hold(fault, lambda: _signal(pid, signal.SIGCONT))
        elif fault.action == "freeze_worker":
            pid = job.signal_role("worker", fault.target, signal.SIGSTOP)
            done = pid is not None
            if done:  # never continued: at --task_timeout the master takes its task back and replaces it
                self.holds.append(_Hold(fault, lambda: _signal(pid, signal.SIGKILL), float("inf"), float("inf"),
                                        gone=lambda: not _alive([pid])))
        elif fault.action == "kill_master":
            done = job.signal_role("master", 0, signal.SIGKILL) is not None
            self.master_killed = self.master_killed or done
        elif fault.action == "kill_etcd":
            done = job.etcd is not None and job.etcd.running
            if done:
                job.etcd.kill()
                self._hold(fault, lambda: job.etcd.running or job.etcd.start())
        elif fault.action == "cut_store":
            done = job.proxy is not None and not job.proxy.is_cut
            if done:
                job.proxy.cut()
                self._hold(fault, job.proxy.heal)
        elif fault.action == "scale":
            job.scale(fault.arg)
        elif fault.action == "damage_cut":
            path = damage_newest_cut(job.ckpt, fault.target)
            done = path is not None
            if done:
                self.outcome.damaged.append(path)
                if fault.arg:
                    self.outcome.ps_kills += job.signal_role("ps", fault.target, signal.SIGKILL) is not None
        (self.outcome.injected if done else self.outcome.skipped).append(fault.describe())


def damage_newest_cut(ckpt: str, target: int) -> str | None:
    """Damage one shard file of the newest complete cut, as a disk might: cut it to half its size
    (even ``target``) or overwrite 64 bytes in its middle (odd). Its path, or None without a cut."""
    versions = complete_versions(ckpt) if os.path.isdir(ckpt) else []
    if not versions:
        return None
    directory = os.path.join(ckpt, f"version-{versions[-1]}")
    shards = sorted(f for f in os.listdir(directory) if f.startswith("ps-") and f.endswith(".npz"))
    path = os.path.join(directory, shards[target % len(shards)])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if target % 2 == 0:
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            f.write(random.Random(target).randbytes(64))
    return path


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run(plan: Plan, faults: list[Fault], data: str, run_dir: str, deadline: float,
        training_data: str = "") -> Outcome:
    """Run the seed's job to its end (or its deadline) under its faults (``training_data``: a stream's)."""
    job = ChaosJob(plan, data, run_dir, training_data)
    started = time.monotonic()
    job.start()
    nemesis = Nemesis(job, faults)
    outcome = nemesis.outcome
    stall = StallWatch(STALL, since=started)
    try:
        while True:
            now = time.monotonic()
            if now - started > deadline:
                outcome.notes.append(f"still running after the {deadline:.0f}s deadline")
                break
            job.poll()
            nemesis.step()
            if stall.stalled((len(job.events.cuts), len(job.master_log())), now, held=bool(nemesis.holds)):
                outcome.notes.append(f"no progress for {STALL:.0f}s (deadline: no new cut, no master log line)")
                break
            code = job.master.poll()
            if code is None:
                time.sleep(POLL)  # the job is another process: poll its state, faults fire on what it shows
                continue
            if code != 0 and _restartable(job, nemesis) and outcome.master_restarts < MAX_MASTER_RESTARTS:
                nemesis.release_all()  # a store the nemesis cut is healed before the master comes back
                outcome.orphans += job.wait_children_gone()
                outcome.master_restarts += 1
                nemesis.master_killed = False
                job.start_master()
                continue
            outcome.returncode = code
            break
        nemesis.release_all()
        if outcome.returncode is not None:
            outcome.orphans += job.wait_children_gone()
        outcome.skipped += [f.describe() for f in nemesis.pending]
        outcome.master_log_tail = "\n".join(job.master_log().splitlines()[-25:])
        outcome.notes.append(f"master: {job.command_line()}")
    finally:
        job.stop_everything()
        outcome.seconds = time.monotonic() - started
    return outcome


def _restartable(job: ChaosJob, nemesis: Nemesis) -> bool:
    """The master's exit was the nemesis's doing and a restart resumes the job (etcd only)."""
    if job.plan.store != "etcd":
        return False
    return nemesis.master_killed or "lost the leader lock" in job.master_log()[job.log_offset:]
