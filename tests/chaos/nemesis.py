"""The random nemesis on real processes: ``python -m tests.chaos.nemesis --seeds N`` (``make chaos``).

Each seed runs one real job (local backend, real gRPC, a real etcd when its plan draws one),
injects its seeded faults on the job's events, and checks the outcome from outside
(checks.py). One line per run, a replay command under each violation, and last::

    N seeds, F faults, V invariant violations

Options: ``--seeds N`` (seeds 0..N-1, from ``--first``), ``--seed S`` (one seed: a replay),
``--mode NAME`` (every seed in one mode), ``--epochs``, ``--max-faults``, ``--deadline`` (s per
run), ``--workdir`` (runs kept there: a violation's directory is kept, a passing one removed),
``--results FILE`` (one JSON line per run, for the figures in docs/reliability.md), ``--budget S``
(start no seed after S seconds).

Shard replicas (``--ps_replicas 1``, issue 26) run with ``--mode replicas-sync`` or
``--mode replicas-async`` (a seed's default mode stays among modes.MODES, so that the seeds
quoted in docs/reliability.md replay as they did). Such a run is also held to the replicas'
promise: one PS SIGKILL (and no other PS or master fault) rolls nothing back, its shards go on
from their backups (the report's ``ps_rollbacks`` empty, ``ps_failovers`` listing them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

from tests.chaos.checks import Verdict, check, read_report
from tests.chaos.modes import MODE_NAMES, Mode, Plan, mode_named, prepare_data
from tests.chaos.runner import Outcome, run
from tests.chaos.schedule import Fault, plan_for, schedule_for
from tests.chaos.stream import STREAM, StreamFeed, check_stream, stream_schedule

REPLICA_MODES = (
    Mode("replicas-sync", {"ps_replicas": 1}, num_workers=1, num_ps=(2, 3)),
    Mode("replicas-async", {"use_async": True, "ps_replicas": 1}, num_workers=2, num_ps=(2, 3)),
)
# --mode stream (tests/chaos/stream.py): a Kafka stream job, its own broker and producer beside it.
OTHER_MODES = (*REPLICA_MODES, STREAM)
ALL_MODE_NAMES = MODE_NAMES + tuple(m.name for m in OTHER_MODES)
# Faults that, beside one PS kill, may send a replicas job back to its cut by design.
ROLLBACK_FAULTS = ("kill_ps", "stop_ps", "damage_cut", "kill_master", "kill_etcd", "cut_store", "stop_master")


def any_mode(name: str) -> Mode:
    return next((m for m in OTHER_MODES if m.name == name), None) or mode_named(name)


def replica_problems(plan: Plan, outcome: Outcome, report: dict | None) -> list[str]:
    """One PS SIGKILL of a replicas job that succeeded: no rollback, a failover reported."""
    if not plan.mode.flags.get("ps_replicas") or outcome.returncode != 0 or report is None:
        return []
    faults = [re.split(r"[\[@ +]", f)[0] for f in outcome.injected]
    if outcome.ps_kills != 1 or outcome.master_restarts or [f for f in faults if f in ROLLBACK_FAULTS] != ["kill_ps"]:
        return []
    problems = []
    if report.get("ps_rollbacks"):
        problems.append(f"one PS killed with --ps_replicas, and the job rolled back: {report['ps_rollbacks']}")
    if not report.get("ps_failovers"):
        problems.append("one PS killed with --ps_replicas, and the report lists no failover")
    return problems


@dataclass
class Settings:
    epochs: int = 3
    max_faults: int = 3
    deadline: float = 240.0
    mode: str = ""
    workdir: str = ""


@dataclass
class Result:
    plan: Plan
    faults: list[Fault]
    outcome: Outcome
    verdict: Verdict
    run_dir: str


def run_seed(seed: int, settings: Settings, workdir: str) -> Result:
    plan = plan_for(seed, settings.epochs, any_mode(settings.mode) if settings.mode else None)
    data = prepare_data(plan.mode.model, os.path.join(workdir, "data"))
    run_dir = os.path.join(workdir, f"seed-{seed}-{plan.mode.name}")
    shutil.rmtree(run_dir, ignore_errors=True)
    if plan.mode is STREAM:
        faults = stream_schedule(plan, settings.max_faults)
        feed = StreamFeed(data, run_dir)
        feed.start()
        try:
            outcome = run(plan, faults, data, run_dir, settings.deadline, training_data=feed.url)
        finally:
            feed.stop()
        return Result(plan, faults, outcome, check_stream(plan, outcome, run_dir, feed.produced, feed.done), run_dir)
    faults = schedule_for(plan, settings.max_faults)
    outcome = run(plan, faults, data, run_dir, settings.deadline)
    verdict = check(plan, outcome, run_dir, data)
    problems = replica_problems(plan, outcome, read_report(run_dir, plan))
    if problems:
        verdict = Verdict("violation", [*verdict.problems, *problems], verdict.known)
    return Result(plan, faults, outcome, verdict, run_dir)


def replay_command(seed: int, settings: Settings) -> str:
    defaults = Settings()
    extra = "".join(f" --{name.replace('_', '-')} {getattr(settings, name)}"
                    for name in ("epochs", "max_faults", "mode") if getattr(settings, name) != getattr(defaults, name))
    return f"python -m tests.chaos.nemesis --seed {seed}{extra}"


def line(result: Result) -> str:
    plan, outcome = result.plan, result.outcome
    faults = ", ".join(outcome.injected) or "none"
    skipped = f" (not reached: {', '.join(outcome.skipped)})" if outcome.skipped else ""
    restarts = f", {outcome.master_restarts} master restarts" if outcome.master_restarts else ""
    return (f"seed {plan.seed:>4} {plan.mode.name:<10} {plan.store:<6} ps={plan.num_ps} {outcome.seconds:5.1f}s "
            f"faults: {faults}{skipped}{restarts} -> {result.verdict.describe()}")


def record(result: Result) -> dict:
    return {
        "seed": result.plan.seed, "mode": result.plan.mode.name, "store": result.plan.store,
        "num_ps": result.plan.num_ps, "epochs": result.plan.epochs, "injected": result.outcome.injected,
        "skipped": result.outcome.skipped, "master_restarts": result.outcome.master_restarts,
        "seconds": round(result.outcome.seconds, 1), "verdict": result.verdict.kind,
        "problems": result.verdict.problems, "known": result.verdict.known, "run_dir": result.run_dir,
    }


def summary(results: list[Result]) -> list[str]:
    """Per mode: runs, faults injected, violations; then the last line."""
    lines = []
    for mode in ALL_MODE_NAMES:
        mine = [r for r in results if r.plan.mode.name == mode]
        if mine:
            kinds = Counter(r.verdict.kind for r in mine)
            lines.append(f"  {mode:<10} runs {len(mine):>3}, faults {sum(len(r.outcome.injected) for r in mine):>3}, "
                         f"ok {kinds['ok']}, failed as allowed {kinds['failed-allowed']}, "
                         f"violations {kinds['violation']}")
    faults = sum(len(r.outcome.injected) for r in results)
    violations = sum(r.verdict.kind == "violation" for r in results)
    lines.append(f"{len(results)} seeds, {faults} faults, {violations} invariant violations")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.nemesis", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="run seeds FIRST..FIRST+N-1")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable): a replay")
    parser.add_argument("--mode", default="", choices=("", *ALL_MODE_NAMES), help="every seed in this mode")
    parser.add_argument("--epochs", type=int, default=Settings.epochs)
    parser.add_argument("--max-faults", type=int, default=Settings.max_faults)
    parser.add_argument("--deadline", type=float, default=Settings.deadline, help="seconds a run may take")
    parser.add_argument("--workdir", default="", help="where runs go (default: a temporary directory)")
    parser.add_argument("--results", default="", help="append one JSON line per run to this file")
    parser.add_argument("--budget", type=float, default=0.0, help="start no seed after this many seconds (0: no limit)")
    args = parser.parse_args(argv)
    settings = Settings(args.epochs, args.max_faults, args.deadline, args.mode)
    seeds = args.seed or list(range(args.first, args.first + args.seeds))
    workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="elasticdl-chaos-")
    results, started = [], time.monotonic()
    for seed in seeds:
        if args.budget and time.monotonic() - started > args.budget:
            print(f"budget of {args.budget:.0f}s spent: seeds from {seed} not run", flush=True)
            break
        result = run_seed(seed, settings, workdir)
        results.append(result)
        print(line(result), flush=True)
        if result.verdict.kind == "violation":
            print(f"    replay: {replay_command(seed, settings)}   (kept: {result.run_dir})", flush=True)
        else:
            shutil.rmtree(result.run_dir, ignore_errors=True)
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps(record(result)) + "\n")
    print("\n".join(summary(results)), flush=True)
    return 1 if any(r.verdict.kind == "violation" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
