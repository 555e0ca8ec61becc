"""The invariants a run is held to, checked from outside the job.

The report's word is not enough: the counts come from the data files (how many records and
batches the job has) and from the parameter servers' own files (the final cut's shards hold
their version and the records each PS applied, elasticdl/model/checkpoint.py). A run:

- **succeeded**: its final cut is the newest complete one on disk, and the report names it; every
  shard is at that version, which is the report's and within the fault-free job's bounds
  (modes.version_bounds); every shard applied ``epochs x records per epoch`` records; the report's
  ``exactly_once`` says the same as the files; every epoch counts all its records; the model
  keeps its metric above the model's floor (faults did not wreck it);
- **failed cleanly**: a report with status "failed" and the exit code the process gave (1 or 2),
  for a fault the job cannot survive by design (``check_failure``); any other failure is a violation;
- and in either case ended before its deadline and left no process behind.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from elasticdl.master.controller import MAX_PS_RELAUNCHES
from elasticdl.model.checkpoint import complete_versions
from elasticdl.model.checkpoint_integrity import verify_shard
from tests.chaos.modes import Plan, records_per_epoch, shard_batches, version_bounds
from tests.chaos.runner import MAX_MASTER_RESTARTS, Outcome

_SHARD = re.compile(r"^ps-(\d+)-of-(\d+)(?:\.term-(\d+))?\.npz$")

# Bugs others are fixing (issue 25): a violation whose evidence matches one is tagged with it,
# so that a run shows what is new. The tag never turns a violation into a pass.
KNOWN = (
    ("async PS kill (version -1)", re.compile(r"computed on version -1")),
    ("TellLiveWorkers livelock", re.compile(r"LiveWorkersNotTold|TellLiveWorkers")),
    ("local master SIGSTOP self-fencing", re.compile(r"lost the leader lock .*in-memory", re.S)),
)


@dataclass
class Verdict:
    kind: str  # "ok", "failed-allowed" or "violation"
    problems: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)

    def describe(self) -> str:
        text = self.kind if not self.problems else f"{self.kind}: {'; '.join(self.problems)}"
        return text + (f" [known: {', '.join(self.known)}]" if self.known else "")


@dataclass(frozen=True)
class Shard:
    ps: int
    version: int
    records_applied: int


def read_report(run_dir: str, plan: Plan) -> dict | None:
    try:
        with open(os.path.join(run_dir, "runs", plan.job_name, "report.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def final_cut(ckpt: str) -> tuple[str, list[Shard]] | None:
    """The newest complete cut under ``ckpt``: its directory and its shards as the PS wrote them."""
    versions = complete_versions(ckpt) if os.path.isdir(ckpt) else []
    if not versions:
        return None
    directory = os.path.join(ckpt, f"version-{versions[-1]}")
    by_cut: dict[tuple[int, int], dict[int, str]] = {}
    for name in os.listdir(directory):
        match = _SHARD.match(name)
        if match:
            cut = (int(match.group(3) or 0), int(match.group(2)))
            by_cut.setdefault(cut, {})[int(match.group(1))] = os.path.join(directory, name)
    term, num_ps = max(c for c, ids in by_cut.items() if set(ids) == set(range(c[1])))
    shards = []
    for ps, path in sorted(by_cut[(term, num_ps)].items()):
        if not verify_shard(path):  # its checksum (model/checkpoint_integrity.py): a damaged byte anywhere
            raise ValueError(f"{path} does not verify: the file is damaged")
        with np.load(path) as data:
            shards.append(Shard(ps, int(data["__version__"]), int(data["__records_applied__"])))
    return directory, shards


def check(plan: Plan, outcome: Outcome, run_dir: str, data: str,
          success: Callable[[dict, str], list[str]] | None = None) -> Verdict:
    """``success(report, ckpt)``: the problems of a run that exited 0 (default: a file job's,
    ``check_success``; a stream's is tests/chaos/stream.py's)."""
    problems: list[str] = []
    report = read_report(run_dir, plan)
    if outcome.returncode is None:
        problems.append("hang: " + next((n for n in outcome.notes if "deadline" in n), "no exit code"))
    elif report is None:
        problems.append(f"exit {outcome.returncode} without a report.json")
    elif outcome.returncode == 0:
        ckpt = os.path.join(run_dir, "ckpt")
        problems += success(report, ckpt) if success is not None else check_success(plan, report, ckpt, data)
    else:
        allowed = check_failure(plan, outcome, report, problems)
        if allowed and not problems and not outcome.orphans:
            return Verdict("failed-allowed", [allowed])
    if outcome.orphans:
        problems.append(f"processes left behind after the master ended: {outcome.orphans}")
    verdict = Verdict("violation" if problems else "ok", problems)
    if problems:
        verdict.known = known_bugs(plan, outcome, report, problems)
    return verdict


def reported_final_cut(report: dict, ckpt: str, problems: list[str]):
    """(directory, shards) of the newest complete cut on disk, after checking the report's
    status and that its checkpoint is that cut (each problem appended to ``problems``); None
    when there is no readable cut, which ends the check."""
    if report.get("status") != "succeeded":
        problems.append(f"exit 0 but the report says {report.get('status')!r}")
    try:
        cut = final_cut(ckpt)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        problems.append(f"the final cut cannot be read: {err}")
        return None
    if cut is None:
        problems.append("no complete cut on disk")
        return None
    directory, shards = cut
    if os.path.basename(report.get("checkpoint", "").rstrip("/")) != os.path.basename(directory):
        problems.append(f"the report's checkpoint {report.get('checkpoint')!r} is not the newest complete cut "
                        f"{os.path.basename(directory)}")
    return cut


def check_success(plan: Plan, report: dict, ckpt: str, data: str) -> list[str]:
    problems = []
    train = os.path.join(data, "train")
    per_epoch = records_per_epoch(train)
    records = plan.epochs * per_epoch
    low, high = version_bounds(plan.mode, shard_batches(train, plan.mode.model), plan.epochs)
    cut = reported_final_cut(report, ckpt, problems)
    if cut is None:
        return problems
    directory, shards = cut
    if len(shards) != plan.num_ps:
        problems.append(f"the final cut has {len(shards)} shards, the job {plan.num_ps} PS")
    versions = {s.version for s in shards}
    if len(versions) != 1 or f"version-{versions.pop()}" != os.path.basename(directory):
        problems.append(f"the final cut's shards are at versions {[s.version for s in shards]} "
                        f"(in {os.path.basename(directory)})")
    version = shards[0].version
    if report.get("model_version") != version:
        problems.append(f"the report says version {report.get('model_version')}, the PS files {version}")
    if not low <= version <= high:
        fault_free = f"{low}" if low == high else f"{low}..{high}"
        problems.append(f"final version {version}, the fault-free job's is {fault_free}")
    applied = [s.records_applied for s in shards]
    if applied != [records] * len(shards):
        problems.append(f"the PS applied {applied} records, the data has {records} ({plan.epochs} x {per_epoch})")
    once = report.get("exactly_once", {})
    if once.get("records_applied") != applied or once.get("holds") != (applied == [records] * len(shards)):
        problems.append(f"the report's exactly_once {once} is not what the PS files hold ({applied})")
    if report.get("records_done_per_epoch") != [per_epoch] * plan.epochs:
        problems.append(f"records done per epoch {report.get('records_done_per_epoch')}, expected "
                        f"{[per_epoch] * plan.epochs}")
    model = plan.mode.model
    value = report.get("metrics", {}).get(model.metric)
    if value is None or not value >= model.floor:
        problems.append(f"{model.metric} {value} below {model.floor}")
    return problems


def check_failure(plan: Plan, outcome: Outcome, report: dict, problems: list[str]) -> str:
    """Why the failure is allowed by design ("" if it is not); clean-failure problems go to ``problems``."""
    if report.get("status") != "failed":
        problems.append(f"exit {outcome.returncode} but the report says {report.get('status')!r}")
    if report.get("exit_code") != outcome.returncode or outcome.returncode not in (1, 2):
        problems.append(f"exit {outcome.returncode}, the report's exit_code {report.get('exit_code')}")
    error = str(report.get("error", ""))
    # Only deaths the nemesis caused excuse it: a relaunched PS that dies again by itself (say, on
    # a damaged cut) is the job's failure, not the fault's.
    if outcome.ps_kills > MAX_PS_RELAUNCHES and "died" in error:
        return f"the nemesis killed {outcome.ps_kills} PS, more than the master relaunches ({MAX_PS_RELAUNCHES})"
    if plan.store == "etcd" and "lost the leader lock" in error and outcome.master_restarts >= MAX_MASTER_RESTARTS:
        return f"the master lost its lock after {MAX_MASTER_RESTARTS} restarts"
    first = error.strip().splitlines()[0] if error.strip() else "(no error in the report)"
    problems.append(f"failed ({report.get('failed_step')}): {first[:300]}")
    return ""


def known_bugs(plan: Plan, outcome: Outcome, report: dict | None, problems: list[str]) -> list[str]:
    evidence = "\n".join([*problems, str((report or {}).get("error", "")), outcome.master_log_tail])
    known = [name for name, pattern in KNOWN if pattern.search(evidence)]
    if outcome.damaged and any("fail" in p or "hang" in p for p in problems):
        known.append("damaged newest checkpoint")
    if plan.mode.name == "sync-g2" and any("shards are at versions" in p for p in problems):
        known.append("grads_to_wait 2 version split")
    return known
