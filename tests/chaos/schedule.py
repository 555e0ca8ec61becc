"""A seed's plan and fault schedule: everything drawn from ``random.Random(seed)``, nothing else.

The same seed gives the same job (mode, store, PS count) and the same faults with the same
triggers, so a failing seed is run again with ``--seed S``. What the seed cannot fix is the
timing of real processes: a replay injects the same faults on the same events, and the
processes race as they will.

A fault fires on an event of the job, never on a fixed sleep alone: a new complete checkpoint
cut in ``ckpt/`` (``cut``), the master's next "epoch N of M starts" line (``epoch``), or the
next relaunch the master logs (``relaunch``). A fault with a hold (SIGSTOP, an etcd kill, a
store cut) is undone on its own event (the next cut: the job went on without the frozen role),
or when ``hold_seconds`` pass first, whichever comes first: a frozen sync job makes no cut.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.chaos.modes import MODES, Mode, Plan

# Faults by store: etcd's own faults, and a master restart, need etcd (a restarted master
# without one starts the job over, by design).
# freeze_worker: a SIGSTOP never undone, which only --task_timeout (20 s here) gets the job past.
ANY_STORE = ("kill_ps", "stop_ps", "kill_worker", "stop_worker", "stop_master", "scale", "damage_cut", "freeze_worker")
ETCD_ONLY = ("kill_master", "kill_etcd", "cut_store")
WEIGHTS = {"kill_ps": 4, "stop_ps": 2, "kill_worker": 3, "stop_worker": 2, "stop_master": 1, "scale": 2,
           "damage_cut": 2, "kill_master": 2, "kill_etcd": 2, "cut_store": 2, "freeze_worker": 1}
KILLS = ("kill_ps", "kill_worker", "kill_master")
HOLDS = ("stop_ps", "stop_worker", "stop_master", "kill_etcd", "cut_store")
TRIGGERS = ("cut", "epoch", "cut", "relaunch")


@dataclass(frozen=True)
class Fault:
    action: str
    trigger: str  # "cut", "epoch" or "relaunch": the event after the previous fault that fires it
    count: int  # how many such events to wait for
    target: int  # which instance (taken modulo the live ones when it fires)
    hold_seconds: float = 0.0  # faults with a hold: the longest it lasts (it ends earlier on the next cut)
    arg: int = 0  # scale: the worker count; damage_cut: 1 to kill a PS right after (so that a restore reads it)

    def describe(self) -> str:
        what = {"scale": f"scale to {self.arg}", "damage_cut": "damage_cut" + ("+kill_ps" if self.arg else "")}
        text = what.get(self.action, f"{self.action}[{self.target}]")
        hold = f" for <={self.hold_seconds:.0f}s" if self.hold_seconds else ""
        return f"{text}@{self.trigger}x{self.count}{hold}"


def plan_for(seed: int, epochs: int = 3, mode: Mode | None = None) -> Plan:
    """The seed's job: modes in turn (seed % 7, so a range of seeds covers them all), the rest drawn."""
    rng = random.Random(seed)
    mode = mode or MODES[seed % len(MODES)]
    store = rng.choice(mode.stores)
    num_ps = rng.choice(mode.num_ps)
    return Plan(seed=seed, mode=mode, store=store, num_ps=num_ps, epochs=epochs)


def schedule_for(plan: Plan, max_faults: int = 3) -> list[Fault]:
    """The seed's faults, in the order they fire. Drawn after the plan, from the same seed."""
    rng = random.Random(f"{plan.seed}/faults")
    actions = ANY_STORE + (ETCD_ONLY if plan.store == "etcd" else ())
    faults = []
    for _ in range(rng.randint(1, max_faults)):
        action = rng.choices(actions, [WEIGHTS[a] for a in actions])[0]
        # A relaunch follows only a kill; a job has about 7 cuts and 3 epochs, so counts stay small.
        relaunches = bool(faults) and (faults[-1].action in KILLS or faults[-1].action == "damage_cut" and faults[-1].arg)
        trigger = rng.choice(TRIGGERS if relaunches else ("cut", "epoch", "cut"))
        hold = round(rng.uniform(1.0, 8.0), 1) if action in HOLDS else 0.0
        arg = rng.randint(1, 3) if action == "scale" else int(rng.random() < 0.7) if action == "damage_cut" else 0
        count = rng.choice((1, 1, 2))
        faults.append(Fault(action, trigger, 1 if trigger == "relaunch" else count, rng.randrange(3), hold, arg))
    return faults
