"""Shared helpers: paths, the per-process thread budget, child processes, statistics."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_MODEL_ZOO = os.path.join(REPO, "benchmarks", "model_zoo")
RESULT_PREFIX = "BENCH_RESULT "

# Environment of every process a benchmark starts (and of the processes those start):
# quiet TensorFlow, numpy/BLAS/OpenMP single-threaded. TensorFlow's own pools are set
# per process by each competitor (see training.py); numpy on the ElasticDL PS is
# single-threaded for element-wise work anyway.
CHILD_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark child; it dies with this process (see die_with_parent).

    Every competitor's processes get ElasticDL's role environment (its malloc settings), as
    ElasticDL's own roles do: the same allocator for everyone.
    """
    from elasticdl.launch.api import ROLE_ENV
    from elasticdl.launch.child import PARENT_PID_ENV

    env = dict(os.environ)
    env.update(ROLE_ENV)
    env.update(CHILD_ENV)
    env[PARENT_PID_ENV] = str(os.getpid())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildFailed(RuntimeError):
    pass


def run_child(module: str, spec: dict, cwd: str, timeout: float, log_path: str) -> dict:
    """Run ``python -m module --spec JSON``; return the dict it printed after RESULT_PREFIX."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    started = time.time()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", module, "--spec", json.dumps(spec)],
                cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=log, text=True,
                timeout=timeout, stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as err:
            raise ChildFailed(f"{module} timed out after {timeout:.0f}s; see {log_path}") from err
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    if proc.returncode != 0 or result is None:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-25:])
        raise ChildFailed(f"{module} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result.setdefault("wall_s", round(time.time() - started, 2))
    return result


def job_report(out_path: str, returncode: int, job: str) -> dict:
    """The report an ``elasticdl train`` printed to ``out_path`` (its stdout); an error naming
    the files to read when the job failed."""
    with open(out_path) as f:
        text = f.read()
    if returncode != 0 or "{" not in text:
        raise RuntimeError(f"{job} exited {returncode}; see {out_path} and its .err")
    return json.loads(text[text.index("{"):])


def emit(result: dict) -> None:
    """A child's answer to run_child: one line on stdout."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def paired_ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float]:
    """Ratios of runs made in the same repetition (run back to back)."""
    return [a / b for a, b in zip(num, den) if a is not None and b]


def machine_info() -> dict:
    info = {"nproc": cores(), "python": sys.version.split()[0]}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
                    break
    except OSError:
        pass
    return info
