"""One real job under the nemesis: its processes, the events it shows, and the faults done to it.

The job runs as a user runs it: ``python -m elasticdl train`` (the master, local backend) in its
own directory, with a real etcd behind a proxy the nemesis can cut (``store == "etcd"``). The
roles are found by their pid files (``runs/<job>/logs/<role>-<i>.pid``), the events by what the
job writes anyway: complete checkpoint cuts in ``ckpt/`` and the master's log lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from elasticdl.model.checkpoint import complete_versions
from tests.chaos.modes import Plan, train_command
from tests.chaos.proxy import HealableProxy
from tests.etcd_fixture import EtcdProcess, etcd_binary
from tests.test_e2e_local import _alive, _children_of

EPOCH_LINE = re.compile(r"epoch \d+ of \d+ starts")
RELAUNCH_LINE = re.compile(r"relaunching it on port|worker \d+ started")


@dataclass
class Events:
    """Counts of what the job showed so far; they only grow, across master restarts."""

    cuts: set[int] = field(default_factory=set)
    epochs: int = 0
    relaunches: int = 0

    def count(self, kind: str) -> int:
        return {"cut": len(self.cuts), "epoch": self.epochs, "relaunch": self.relaunches}[kind]


class ChaosJob:
    """The job's processes and the levers on them. ``poll()`` refreshes ``events``."""

    def __init__(self, plan: Plan, data: str, run_dir: str, training_data: str = ""):
        self.plan = plan
        self.training_data = training_data  # a stream's kafka:// address (stream.py); "": the data's files
        self.data = data
        self.run_dir = run_dir
        self.ckpt = os.path.join(run_dir, "ckpt")
        self.log_dir = os.path.join(run_dir, "runs", plan.job_name, "logs")
        self.events = Events()
        self.etcd: EtcdProcess | None = None
        self.proxy: HealableProxy | None = None
        self.master: subprocess.Popen | None = None
        self.masters: list[int] = []  # every master pid, to find their children
        self._log_counts = (0, 0)  # epoch and relaunch lines in the current master.log
        self._log_base = (0, 0)  # counts of master.log files before this one (should one start again)
        self.scalers: list[subprocess.Popen] = []
        self.log_offset = 0

    # --- processes -------------------------------------------------------------------------------
    def start(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        if self.plan.store == "etcd":
            binary = etcd_binary()
            if binary is None:
                raise SystemExit("the etcd binary is not on PATH (Debian/Ubuntu: apt-get install etcd-server)")
            os.makedirs(os.path.join(self.run_dir, "etcd"), exist_ok=True)
            self.etcd = EtcdProcess(binary, os.path.join(self.run_dir, "etcd"))
            self.etcd.start()
            self.proxy = HealableProxy(("127.0.0.1", self.etcd.client_port))
        self.start_master()

    def start_master(self) -> None:
        command = train_command(self.plan, self.data, self.proxy.endpoint if self.proxy else "", self.training_data)
        env = dict(os.environ)
        env.setdefault("ELASTICDL_LOCAL_SPARES", "0")  # one TensorFlow process less per role on 2 cores
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo(), env.get("PYTHONPATH", "")) if p)
        self.log_offset = len(self.master_log())  # where this master's own lines begin
        with open(os.path.join(self.run_dir, f"master-{len(self.masters)}.out"), "w") as out:
            self.master = subprocess.Popen(command, cwd=self.run_dir, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.masters.append(self.master.pid)

    def command_line(self) -> str:
        return " ".join(train_command(self.plan, self.data, self.proxy.endpoint if self.proxy else "", self.training_data))

    def children(self) -> list[int]:
        return _alive([pid for master in self.masters for pid in _children_of(master)])

    def pids(self, role: str) -> list[int]:
        """The live processes of ``role`` ("ps" or "worker"), by index."""
        found = []
        for name in sorted(os.listdir(self.log_dir)) if os.path.isdir(self.log_dir) else []:
            match = re.match(rf"{role}-(\d+)\.pid$", name)
            if match:
                try:
                    with open(os.path.join(self.log_dir, name)) as f:
                        pid = int(f.read().strip())
                except (OSError, ValueError):
                    continue
                if _alive([pid]):
                    found.append(pid)
        return found

    def signal_role(self, role: str, target: int, sig: int) -> int | None:
        """Send ``sig`` to instance ``target`` (modulo the live ones) of ``role``; its pid, or None."""
        if role == "master":
            pids = [self.master.pid] if self.master and self.master.poll() is None else []
        else:
            pids = self.pids(role)
        if not pids:
            return None
        pid = pids[target % len(pids)]
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return None
        return pid

    def scale(self, workers: int) -> None:
        """``elasticdl scale``, not waited for here: a frozen master would hold the nemesis."""
        self.scalers.append(subprocess.Popen(
            [sys.executable, "-m", "elasticdl", "scale", "--job_name", self.plan.job_name, "--num_workers", str(workers)],
            cwd=self.run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))

    def stop_everything(self) -> None:
        for pid in [*self.children(), *([self.master.pid] if self.master and self.master.poll() is None else [])]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if self.master is not None:
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for scaler in self.scalers:
            if scaler.poll() is None:
                scaler.kill()
            scaler.wait()
        if self.proxy is not None:
            self.proxy.close()
        if self.etcd is not None:
            self.etcd.stop()

    def wait_children_gone(self, timeout: float = 15.0) -> list[int]:
        """The children still alive ``timeout`` s after their master ended (orphans), or []."""
        deadline = time.monotonic() + timeout
        while (left := self.children()) and time.monotonic() < deadline:
            time.sleep(0.2)  # a poll of other processes' state, bounded by the deadline: no window to race
        return left

    # --- events ----------------------------------------------------------------------------------
    def master_log(self) -> str:
        try:
            with open(os.path.join(self.log_dir, "master.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def poll(self) -> None:
        for version in complete_versions(self.ckpt) if os.path.isdir(self.ckpt) else []:
            self.events.cuts.add(version)
        log = self.master_log()
        counts = (len(EPOCH_LINE.findall(log)), len(RELAUNCH_LINE.findall(log)))
        if counts < self._log_counts:  # the file started again (it is appended to: a guard)
            self._log_base = tuple(b + c for b, c in zip(self._log_base, self._log_counts))
        self._log_counts = counts
        self.events.epochs, self.events.relaunches = (b + c for b, c in zip(self._log_base, counts))


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
