"""``python -m elasticdl.sim --seeds N [--seed S] [--mode FAMILY] [--plant BUG] [--jobs J] [--verbose]``.

Runs seeds S, S+1, ..., S+N-1, prints a replayable command for every seed that violated an
invariant, and ends with exactly ``N seeds, F faults, V invariant violations``.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

from elasticdl.sim.modes import ALL_FAMILIES, FAMILIES
from elasticdl.sim.planted import PLANTS, planted
from elasticdl.sim.world import RunResult, World


def run_seed(seed: int, family: str | None = None, plant: str | None = None) -> RunResult:
    with planted(plant):
        return World(seed, family).run()


def _run(args: tuple[int, str | None, str | None]) -> RunResult:
    return run_seed(*args)


def run_seeds(seeds: Iterable[int], family: str | None = None, jobs: int = 1,
              plant: str | None = None) -> Iterable[RunResult]:
    work = [(seed, family, plant) for seed in seeds]
    if jobs <= 1:
        yield from map(_run, work)
        return
    # Spawned, not forked: a process that has run TensorFlow (a test process that ran other
    # files first) holds tf.data iterators whose threads a fork does not copy; a forked child
    # that garbage-collects one waits for those threads for ever (seen as a hung `make test`).
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(_run, work, chunksize=16)


def replay_command(result: RunResult, family: str | None, plant: str | None = None) -> str:
    mode = f" --mode {family}" if family else ""
    bug = f" --plant {plant}" if plant else ""
    return f"python -m elasticdl.sim --seed {result.seed} --seeds 1{mode}{bug} --verbose"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m elasticdl.sim", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--mode", choices=ALL_FAMILIES, default=None, help="run only this mode family")
    parser.add_argument("--plant", choices=sorted(PLANTS), default=None,
                        help="plant a known bug back (elasticdl/sim/planted.py): the run should find it")
    parser.add_argument("--jobs", type=int, default=1, help="processes to run seeds in")
    parser.add_argument("--verbose", action="store_true", help="print each seed's mode, faults and violations")
    parser.add_argument("--by_mode", action="store_true", help="before the last line, the figures of each mode family")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be 1 or more. Received: {args.seeds}")
    logging.disable(logging.CRITICAL)  # the real code logs every fault it rides out
    faults = violations = 0
    families: dict[str, list[int]] = {}
    for result in run_seeds(range(args.seed, args.seed + args.seeds), args.mode, args.jobs, args.plant):
        faults += len(result.faults)
        violations += len(result.violations)
        figures = families.setdefault(result.mode.family, [0, 0, 0])
        figures[0] += 1
        figures[1] += len(result.faults)
        figures[2] += len(result.violations)
        if args.verbose:
            print(f"seed {result.seed}: {result.mode.name}, {result.steps} steps, {result.sim_seconds}s simulated, "
                  f"{result.outcome or 'not finished'}")
            for fault in result.faults:
                print(f"  fault {fault}")
        if result.violations:
            print(f"seed {result.seed} ({result.mode.name}): {result.violations[0]}")
            for extra in result.violations[1:3] if args.verbose else ():
                print(f"  also: {extra}")
            print(f"  replay: {replay_command(result, args.mode, args.plant)}")
    if args.by_mode:
        for family in (f for f in ALL_FAMILIES if f in FAMILIES or f in families):  # extra ones if run
            seeds, family_faults, family_violations = families.get(family, [0, 0, 0])
            print(f"  {family}: {seeds} seeds, {family_faults} faults, {family_violations} invariant violations")
    print(f"{args.seeds} seeds, {faults} faults, {violations} invariant violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
