"""Issue 26's acceptance runs of ``--ps_replicas``, in full (not in ``make test``: minutes).

    python -m benchmarks.replicas_acceptance                  # sync and async, 20 epochs
    python -m benchmarks.replicas_acceptance --modes sync --epochs 8 --kill_epoch 3
    make replicas-acceptance

Per mode, the fault-free job, then the same job with ``--ps_replicas 1`` and ps-1 SIGKILLed as
epoch ``--kill_epoch`` starts: 1 worker, 2 PS, model_zoo/digits (minibatch 32, tasks of 128
records). ``sync``: the default consistency, with ``--checkpoint_dir`` (a rollback to a cut would
be possible: none may happen); ``async``: ``--use_async`` with no ``--checkpoint_dir`` at all
(nothing to fall back to: nothing may be lost). Each faulted job must exit 0 at the fault-free
job's final model version, with ``ps_rollbacks`` empty, no record retrained or possibly
missing, ``exactly_once`` holding and the failover in ``ps_failovers`` (shard 1, from PS 1 to
PS 0, its pause). Prints a table of the checks and figures, writes ``results.json`` under
``--out``; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from benchmarks.common import REPO, child_env, job_report
from benchmarks.elastic_recovery import _die_with_this_process, _lines, _role_pids, _wait_for

MODEL_DEF = "digits.digits_functional.custom_model"
MODES = {"sync": {}, "async": {"use_async": True}}


def _log(message: str) -> None:
    sys.stderr.write(f"[replicas_acceptance {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def _command(args, data: str, job: str, mode: str, workdir: str, replicas: int) -> list[str]:
    flags = {"model_zoo": os.path.join(REPO, "model_zoo"), "model_def": MODEL_DEF, "training_data": data,
             "minibatch_size": 32, "records_per_task": 128, "num_epochs": args.epochs, "num_workers": 1,
             "num_ps": 2, "ps_replicas": replicas, "job_name": job, **MODES[mode]}
    if mode == "sync":
        flags.update(checkpoint_dir=os.path.join(workdir, f"{job}-ckpt"), checkpoint_steps=100)
    return [sys.executable, "-m", "elasticdl", "train", *(f"--{k}={v}" for k, v in flags.items())]


def _run(command: list[str], workdir: str, job: str, kill_epoch: int, epochs: int, timeout: float) -> tuple[dict, float]:
    """(the job's report, seconds); with ``kill_epoch``, ps-1 SIGKILLed as that epoch starts."""
    shutil.rmtree(os.path.join(workdir, "runs", job), ignore_errors=True)
    out_path = os.path.join(workdir, f"{job}.out")
    started = time.time()
    with open(out_path, "w") as out, open(os.path.join(workdir, f"{job}.err"), "w") as err:
        proc = subprocess.Popen(command, cwd=workdir, env=child_env(), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_this_process)
        try:
            if kill_epoch:
                logs = os.path.join(workdir, "runs", job, "logs")
                mark = f"epoch {kill_epoch} of {epochs} starts"
                _wait_for(mark, lambda: any(mark in line for line in _lines(os.path.join(logs, "master.log"))),
                          timeout, proc)
                os.kill(_role_pids(proc.pid, logs, "ps")[1], signal.SIGKILL)
                _log(f"{job}: ps-1 SIGKILLed as {mark}")
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return job_report(out_path, proc.returncode, job), time.time() - started


def checks(report: dict, reference: dict) -> dict[str, bool]:
    """The acceptance's checks of one faulted job against its fault-free twin."""
    retrained = sum(sum(v for k, v in e.items() if k != "epoch") for e in report["records_retrained"])
    failovers = [(f["shard"], f["old_primary"], f["new_primary"]) for f in report["ps_failovers"]]
    return {
        "exit 0": report["status"] == "succeeded",
        "final version = fault-free": report["model_version"] == reference["model_version"],
        "ps_rollbacks empty": report["ps_rollbacks"] == [],
        "nothing retrained": retrained == 0,
        "nothing possibly missing": report["records_possibly_missing"] == 0,
        "exactly_once holds": bool(report["exactly_once"].get("holds")),
        "failover reported (shard 1, PS 1 -> 0)": failovers == [(1, 1, 0)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas_acceptance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,async", help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--kill_epoch", type=int, default=6, help="ps-1 is SIGKILLed as this epoch starts")
    parser.add_argument("--out", default=os.path.join("runs", "replicas_acceptance"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    args = parser.parse_args(argv)
    if not 1 < args.kill_epoch <= args.epochs:
        parser.error(f"--kill_epoch must be within 2..--epochs ({args.epochs}). Received: {args.kill_epoch}")
    from benchmarks.data import prepare

    workdir = os.path.abspath(args.out)
    os.makedirs(workdir, exist_ok=True)
    data = prepare(os.path.join(workdir, "data"), {"digits": {"kind": "digits"}})["digits"]["dir"]
    results, failed = {}, False
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
        reference, clean_s = _run(_command(args, data, f"acceptance-{mode}-clean", mode, workdir, 0), workdir,
                                  f"acceptance-{mode}-clean", 0, args.epochs, args.timeout)
        job = f"acceptance-{mode}-kill"
        report, kill_s = _run(_command(args, data, job, mode, workdir, 1), workdir, job, args.kill_epoch,
                              args.epochs, args.timeout)
        results[mode] = {"checks": checks(report, reference), "fault_free_s": clean_s, "faulted_s": kill_s,
                         "model_version": report["model_version"], "reference_version": reference["model_version"],
                         "ps_failovers": report["ps_failovers"], "exactly_once": report["exactly_once"]}
        failed |= not all(results[mode]["checks"].values())
    lines = ["| mode | check | result |", "|---|---|---|"]
    for mode, r in results.items():
        lines += [f"| {mode} | {name} | {'PASS' if ok else 'FAIL'} |" for name, ok in r["checks"].items()]
        pauses = ", ".join(f"{f['pause_seconds']:.3f} s at version {f['version']}" for f in r["ps_failovers"])
        lines.append(f"| {mode} | version {r['model_version']} (fault-free {r['reference_version']}); "
                     f"jobs {r['fault_free_s']:.0f} s fault-free, {r['faulted_s']:.0f} s with the kill; "
                     f"failover pause {pauses or '-'} | |")
    print("\n".join(lines))
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"epochs": args.epochs, "kill_epoch": args.kill_epoch, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
