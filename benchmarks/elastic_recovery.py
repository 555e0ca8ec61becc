"""Elastic recovery of a real local ElasticDL job (a child process of the runner).

    python -m benchmarks.elastic_recovery --spec '{"reps": 3, "data_dir": "...", "workdir": "..."}'

Every repetition is a fresh ``python -m elasticdl train`` of model_zoo/digits (local
backend, 1 PS, default sync SGD, 1 TensorFlow thread per process) over the digits written
10 times over (long epochs: a worker waits between tasks only at an epoch's end), with more
epochs than it will ever finish; it is interrupted once both figures are taken:

- ``scale_up``: once worker 0 has pushed its first gradient, ``elasticdl scale
  --num_workers 2`` (from 1 worker to N+1); the figure is the seconds from running that
  command to the new worker's "first gradient pushed" log line: the request, the process
  start, TensorFlow's import, the model build, a task, a pull and a gradient.
- ``kill_worker``: once both workers train, worker 0 is SIGKILLed in the middle of a task;
  the figure is the seconds from the kill to the master's "requeued task N now runs on
  worker M" line: the master notices the exit, puts the task back at the front of the
  queue, and the surviving worker takes it when it asks for its next task.

- ``kill_ps``: a second job per repetition (1 worker, 2 PS, sync, ``--checkpoint_steps
  40``). Once the first cut (version 40) is complete on disk, PS 1 is SIGKILLed; the
  figure is the seconds from the kill until training goes on again: the surviving PS 0,
  polled every 10 ms, went back to the cut (the rollback) and then past it (a gradient
  applied on the restored model). The records trained again are the master's count.

The scale-up is measured first so that no replacement worker (the master refills a killed
worker's slot) is starting up while it runs. Times on both sides are wall-clock: the
benchmark's ``time.time()`` when it acts, the logs' ``HH:MM:SS.mmm`` stamps of the event.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

from benchmarks.common import REPO, child_env, emit

MODEL_ZOO = os.path.join(REPO, "model_zoo")
MODEL_DEF = "digits.digits_functional.custom_model"
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) ")
_REQUEUED = re.compile(r"requeued task (\d+) now runs on worker (\d+)")
_GONE = re.compile(r"worker (\d+) is gone; requeued tasks \[([\d, ]*)\]")
_STARTED = re.compile(r"worker (\d+) started")
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _log(message: str) -> None:
    sys.stderr.write(f"[elastic_recovery {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def _die_with_this_process() -> None:
    """preexec_fn of the job's master: `elasticdl train` does not die with its parent by
    itself, and a benchmark killed on its timeout must not leave a long job behind (the
    master's own children die with the master)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# ---------------------------------------------------------------- logs


def _stamp(line: str, near: float) -> float | None:
    """The wall-clock time of a log line (``HH:MM:SS.mmm`` local time), on the day closest to ``near``."""
    match = _STAMP.match(line)
    if not match:
        return None
    h, m, s, ms = (int(g) for g in match.groups())
    day = datetime.datetime.fromtimestamp(near).date()
    t = datetime.datetime.combine(day, datetime.time(h, m, s, ms * 1000)).timestamp()
    if t - near > 43_200:  # the log line is from before midnight, ``near`` after it
        t -= 86_400
    elif near - t > 43_200:
        t += 86_400
    return t


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readlines()
    except FileNotFoundError:
        return []


def _first_gradient(path: str, near: float) -> float | None:
    for line in _lines(path):
        if "first gradient pushed" in line:
            return _stamp(line, near)
    return None


def _wait_for(what: str, predicate, timeout: float, job: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job.poll() is not None:
            raise RuntimeError(f"the job exited ({job.returncode}) while waiting for {what}")
        time.sleep(0.02)
    raise TimeoutError(f"no {what} after {timeout:.0f}s")


def _role_pids(job_pid: int, logs: str, role: str) -> dict[int, int]:
    """index -> pid of the job's live processes of one role: the local backend writes each
    instance's pid beside its log (``<role>-<i>.pid``: a warm spare's command line names no
    index) and marks its children with ELASTICDL_PARENT_PID=<master pid>."""
    marker = f"ELASTICDL_PARENT_PID={job_pid}".encode()
    found = {}
    for name in os.listdir(logs) if os.path.isdir(logs) else []:
        match = re.fullmatch(rf"{role}-(\d+)\.pid", name)
        if not match:
            continue
        try:
            with open(os.path.join(logs, name)) as f:
                pid = int(f.read())
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[-1].split()[0] == "Z"
        except (OSError, ValueError):
            continue
        if not zombie:
            found[int(match.group(1))] = pid
    return found


def _worker_pids(job_pid: int, logs: str) -> dict[int, int]:
    """worker id -> pid of the job's live worker processes."""
    return _role_pids(job_pid, logs, "worker")


# ---------------------------------------------------------------- one repetition


def _start_job(spec: dict, job: str, workdir: str, *extra: str) -> subprocess.Popen:
    shutil.rmtree(os.path.join(workdir, "runs", job), ignore_errors=True)  # logs are appended to
    args = [
        sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO, "--model_def", MODEL_DEF,
        "--training_data", spec["data_dir"], "--minibatch_size", str(spec["minibatch_size"]),
        "--num_minibatches_per_task", str(spec["minibatches_per_task"]), "--num_epochs", str(spec["epochs"]),
        "--num_workers", "1", "--num_ps", "1", "--num_threads_per_process", "1", "--job_name", job,
        "--log_level", "INFO",  # the lines measured are INFO
        *extra,
    ]
    with open(os.path.join(workdir, f"{job}.out"), "w") as out:  # the child keeps its own copy
        return subprocess.Popen(args, cwd=workdir, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_this_process)


def _stop_job(proc: subprocess.Popen) -> None:
    """Ctrl-C: the master stops its PS and workers; SIGKILL if it does not within 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _scale_up(spec: dict, job: str, workdir: str, logs: str, proc: subprocess.Popen) -> dict:
    """1 -> 2 workers: seconds from `elasticdl scale` to the new worker's first gradient."""
    started = time.time()
    scale = subprocess.run(
        [sys.executable, "-m", "elasticdl", "scale", "--job_name", job, "--num_workers", "2"],
        cwd=workdir, env=child_env(), capture_output=True, text=True, timeout=60,
    )
    if scale.returncode != 0:
        raise RuntimeError(f"elasticdl scale failed: {scale.stderr.strip()}")
    answered = time.time()
    master = os.path.join(logs, "master.log")

    def new_worker() -> int | None:
        ids = [int(m.group(1)) for line in _lines(master) if (m := _STARTED.search(line))]
        return next((i for i in ids if i != 0), None)

    worker = _wait_for("the new worker's start", new_worker, spec["timeout"], proc)
    path = os.path.join(logs, f"worker-{worker}.log")
    first = _wait_for("the new worker's first gradient", lambda: _first_gradient(path, started), spec["timeout"], proc)
    decided = next((_stamp(line, started) for line in _lines(master) if "scaling to 2 workers" in line), None)
    return {"scale_up_s": first - started, "scale_command_s": answered - started,
            "after_master_decision_s": (first - decided) if decided else None, "new_worker": worker}


def _kill_worker(spec: dict, logs: str, proc: subprocess.Popen) -> dict:
    """SIGKILL a worker mid-task: seconds until its task runs again on another worker.

    A kill can land between two of the victim's tasks (it then held none: nothing is
    requeued, the master only refills the slot); then another worker is killed, at most
    ``spec["kill_attempts"]`` times.
    """
    for attempt in range(spec["kill_attempts"]):
        out = _kill_once(spec, logs, proc)
        if out is not None:
            return dict(out, attempts=attempt + 1)
        _log(f"the killed worker held no task (attempt {attempt + 1}); killing another")
    raise RuntimeError(f"{spec['kill_attempts']} killed workers held no task")


def _kill_once(spec: dict, logs: str, proc: subprocess.Popen) -> dict | None:
    master = os.path.join(logs, "master.log")
    pids = _wait_for("two training workers", lambda: p if len(p := _worker_pids(proc.pid, logs)) >= 2 else None,
                     spec["timeout"], proc)
    victim = min(pids)  # the longest-running one
    seen = len(_lines(master))
    killed = time.time()
    os.kill(pids[victim], signal.SIGKILL)

    def noticed() -> tuple[str, re.Match] | None:
        for line in _lines(master)[seen:]:
            gone = _GONE.search(line)
            if gone and int(gone.group(1)) == victim:
                return line, gone
            started = _STARTED.search(line)
            if started and int(started.group(1)) not in pids:  # refilled, nothing requeued
                return line, started
        return None

    gone_line, match = _wait_for(f"the master to notice worker {victim}'s exit", noticed, spec["timeout"], proc)
    if match.re is _STARTED:
        replacement = os.path.join(logs, f"worker-{match.group(1)}.log")
        _wait_for("the replacement's first gradient", lambda: _first_gradient(replacement, killed),
                  spec["timeout"], proc)
        time.sleep(spec["settle_s"] + random.uniform(0.0, 1.0))  # away from the epoch start (see one_rep)
        return None
    tasks = {int(t) for t in match.group(2).split(",") if t.strip()}

    def rerun() -> re.Match | None:
        for line in _lines(master)[seen:]:
            again = _REQUEUED.search(line)
            if again and int(again.group(1)) in tasks and int(again.group(2)) != victim:
                return again
        return None

    again = _wait_for("the requeued task to run again", rerun, spec["timeout"], proc)
    return {"kill_worker_s": _stamp(again.string, killed) - killed, "noticed_s": _stamp(gone_line, killed) - killed,
            "killed_worker": victim, "rerun_on": int(again.group(2))}


def one_rep(spec: dict, rep: int, workdir: str) -> dict:
    job = f"recovery-r{rep}"
    logs = os.path.join(workdir, "runs", job, "logs")
    t0 = time.time()
    proc = _start_job(spec, job, workdir)
    try:
        _wait_for("worker 0's first gradient",
                  lambda: _first_gradient(os.path.join(logs, "worker-0.log"), t0), spec["timeout"], proc)
        out = _scale_up(spec, job, workdir, logs, proc)
        _log(f"rep {rep + 1}: scale-up, first gradient of the new worker after {out['scale_up_s']:.2f}s")
        # Both workers in their steady state of tasks. The random part keeps the kill out of
        # step with the event it follows: a worker's first gradient comes right after it got
        # a task, often right after an epoch start, when the other worker may be waiting.
        time.sleep(spec["settle_s"] + random.Random(rep).uniform(0.0, 1.0))
        out.update(_kill_worker(spec, logs, proc))
        _log(f"rep {rep + 1}: killed worker {out['killed_worker']}, its task ran again on worker "
             f"{out['rerun_on']} after {out['kill_worker_s']:.3f}s (exit noticed after {out['noticed_s']:.3f}s)")
    finally:
        _stop_job(proc)
    out["job_s"] = time.time() - t0
    out["log_dir"] = logs
    return out


_PS_AT = re.compile(r"parameter servers at (\S+), (\S+)")
_WENT_BACK = re.compile(r"went back to the checkpoint's data position: (\d+) records")
CUT_STEPS = 40


def cut_flags(workdir: str, job: str) -> list[str]:
    """The PS jobs' checkpoints: a fresh directory, a cut every CUT_STEPS versions."""
    ckpt = os.path.join(workdir, f"{job}-ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    return ["--checkpoint_dir", ckpt, "--checkpoint_steps", str(CUT_STEPS)]


def at_first_cut(spec: dict, job: str, workdir: str, proc: subprocess.Popen) -> tuple[str, tuple, str, int]:
    """Once the job's first cut is complete: (the master's log, the PS addresses, the job's
    token, PS 1's pid)."""
    run_dir = os.path.join(workdir, "runs", job)
    cut = os.path.join(workdir, f"{job}-ckpt", f"version-{CUT_STEPS}")
    _wait_for("the first complete cut", lambda: os.path.isdir(cut) and len(os.listdir(cut)) >= 2, spec["timeout"], proc)
    master = os.path.join(run_dir, "logs", "master.log")
    addresses = next(m.groups() for line in _lines(master) if (m := _PS_AT.search(line)))
    with open(os.path.join(run_dir, "token")) as f:
        token = f.read().strip()
    return master, addresses, token, _role_pids(proc.pid, os.path.join(run_dir, "logs"), "ps")[1]


def ps_rep(spec: dict, rep: int, workdir: str) -> dict:
    """1 worker, 2 PS, sync: SIGKILL PS 1 once a cut is complete; seconds until training goes on."""
    from elasticdl.rpc.ps_client import PSClient

    job = f"ps-recovery-r{rep}"
    proc = _start_job(spec, job, workdir, "--num_ps", "2", *cut_flags(workdir, job))
    try:
        master, addresses, token, victim = at_first_cut(spec, job, workdir, proc)
        survivor = PSClient([addresses[0]], token=token)
        try:
            before = survivor.stats()[0].version
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            rolled_back = None
            while time.time() - killed < spec["timeout"]:
                version = survivor.stats()[0].version
                if rolled_back is None and version < before:
                    rolled_back = (version, time.time())
                elif rolled_back is not None and version > rolled_back[0]:
                    resumed = time.time()
                    break
                before = max(before, version) if rolled_back is None else before
                time.sleep(0.01)
            else:
                raise TimeoutError("training did not go on after the PS was killed")
        finally:
            survivor.close()
        retrained = next((int(m.group(1)) for line in _lines(master) if (m := _WENT_BACK.search(line))), None)
    finally:
        _stop_job(proc)
    return {"kill_ps_s": resumed - killed, "rollback_s": rolled_back[1] - killed, "rolled_back_to": rolled_back[0],
            "ps_records_retrained": retrained}


def run(spec: dict) -> dict:
    workdir = os.path.abspath(spec["workdir"])
    os.makedirs(workdir, exist_ok=True)
    runs: list[dict | None] = []
    errors: list[str] = []
    for rep in range(spec["reps"]):
        try:
            from benchmarks.replicas_recovery import replica_ps_rep  # --ps_replicas 1: the same kill

            runs.append({**one_rep(spec, rep, workdir), **ps_rep(spec, rep, workdir),
                         **replica_ps_rep(spec, rep, workdir)})
        except Exception as err:  # a failed repetition is left out of the medians, never a figure
            _log(f"rep {rep + 1} failed: {type(err).__name__}: {err}")
            runs.append(None)
            errors.append(f"elastic_recovery rep {rep + 1}: {type(err).__name__}: {err}")
    return {"runs": runs, "errors": errors, "spec": spec}


def main() -> None:
    from elasticdl.launch.child import die_with_parent

    die_with_parent()  # no orphans if the benchmark is killed
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="JSON: reps, data_dir, workdir and the job's sizes")
    emit(run(json.loads(parser.parse_args().spec)))


if __name__ == "__main__":
    main()
