"""Kills at a random short delay after a checkpoint cut: the fault windows a cut's neighbours open.

Each seed runs the chaos tests' digits job (1 worker, 2 PS, sync, a cut every 40 versions) and,
once a cut is complete on disk, SIGKILLs ps-1 after a delay drawn from 0-2 s (mode ``one``), or
ps-1 and then ps-0 within 0.5 s (mode ``both``, with ``--ps_replicas 1``: a shard loses both
replicas). The delays land on an epoch's end, an evaluation round's snapshot, the job's last
task and its final checkpoint: the windows where this found five bugs the nemesis had not
(docs/reliability.md, "Kills after a cut"). A job that does not end within 150 s is a hang:
every process's stack is dumped with py-spy into the seed's directory, which is kept.

    python -m tests.chaos.kills_after_a_cut --mode both --seeds 20 --dir /tmp/kills
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.hung_job import explain
from tests.test_e2e_local import MODEL_ZOO

DELAYS = (0, 0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
JOB_SECONDS = 150


def run_seed(seed: int, mode: str, digits: Path, base: Path) -> str:
    rng = random.Random(seed)
    work = base / f"{mode}-{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cut = 40 if mode == "one" else 80
    args = ["train", "--model_zoo", MODEL_ZOO, "--model_def", "digits.digits_functional.custom_model",
            "--training_data", str(digits / "train"), "--validation_data", str(digits / "test"),
            "--minibatch_size", "32", "--num_epochs", "3", "--job_name", "kills", "--num_workers", "1",
            "--num_ps", "2", "--records_per_task", "128", "--checkpoint_dir", str(work / "ckpt"),
            "--checkpoint_steps", "40", *(["--ps_replicas", "1"] if mode == "both" else [])]
    job = subprocess.Popen([sys.executable, "-m", "elasticdl", *args], cwd=work, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    while len(glob.glob(str(work / "ckpt" / f"version-{cut}" / "ps-*-of-2*.npz"))) < 2:
        if job.poll() is not None or time.monotonic() - started > JOB_SECONDS:
            job.kill()
            return f"no cut at version {cut} (exit {job.poll()})"
        time.sleep(0.05)  # polling another process's files: nothing to wait on
    delay = rng.choice(DELAYS)
    time.sleep(delay)  # the fault's moment is what this tool draws
    killed = _kill(work, 1)
    if killed and mode == "both":
        time.sleep(rng.choice((0, 0.01, 0.1, 0.5)))  # ps-0 too, before or after ps-1's recovery
        killed = _kill(work, 0)
    if not killed:
        job.kill()
        return f"delay {delay}: the job had ended before the kill (not counted)"
    try:
        _, err = job.communicate(timeout=JOB_SECONDS)
    except subprocess.TimeoutExpired:
        (work / "stacks.txt").write_text(explain(job.pid, work))  # its logs' tails and every stack
        job.kill()
        return f"delay {delay}: HANG (stacks in {work / 'stacks.txt'})"
    if job.returncode != 0:
        return f"delay {delay}: FAILED, exit {job.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}"
    shutil.rmtree(work, ignore_errors=True)
    return f"delay {delay}: ok"


def _kill(work: Path, ps: int) -> bool:
    try:
        os.kill(int((work / "runs" / "kills" / "logs" / f"ps-{ps}.pid").read_text()), signal.SIGKILL)
        return True
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=("one", "both"), default="one")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "elasticdl-kills"))
    args = parser.parse_args(argv)
    base = Path(args.dir)
    digits = base / "digits"
    if not digits.exists():
        subprocess.run([sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"), "--output",
                        str(digits)], check=True, capture_output=True)
    bad = 0
    for seed in range(args.first, args.first + args.seeds):
        outcome = run_seed(seed, args.mode, digits, base)
        bad += "HANG" in outcome or "FAILED" in outcome
        print(f"seed {seed} ({args.mode}): {outcome}", flush=True)
    print(f"{args.seeds} seeds, {bad} hung or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
