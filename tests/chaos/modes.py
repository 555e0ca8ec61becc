"""The nemesis's mode matrix and the jobs it runs: small, so that one seed takes well under a minute.

A mode is a consistency setting with the worker count and model it runs with. Its plan
(``plan_for``) adds what the seed draws: the state store (memory or a real etcd) and the number
of parameter servers (1 to 3). The batch counts here are computed from the data files alone,
never from what the job reports, so that the checks (checks.py) can hold the job to them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field

from elasticdl.data.sources import count_records, make_shards, resolve_data_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_ZOO = os.path.join(REPO, "model_zoo")
CHECKPOINT_STEPS = 20


@dataclass(frozen=True)
class Model:
    name: str
    model_def: str
    minibatch: int
    records_per_task: int
    metric: str  # the report's metric the model must keep above ``floor`` (a model faults did not wreck)
    floor: float


DIGITS = Model("digits", "digits.digits_functional.custom_model", 32, 128, "accuracy", 0.7)
# DeepFM: embedding tables (elasticdl.layers.Embedding) whose rows live on the PS by id % num_ps.
DEEPFM = Model("deepfm", "deepctr.deepfm.custom_model", 64, 256, "auc", 0.55)


@dataclass(frozen=True)
class Mode:
    name: str
    flags: dict[str, object]
    num_workers: int
    model: Model = DIGITS
    # How many versions the final model may hold, from the batches (see ``version_bounds``).
    versions: str = "batches"  # "batches" (one version per batch), "push_steps", "grads_to_wait"
    stores: tuple[str, ...] = ("memory", "etcd")
    num_ps: tuple[int, ...] = (1, 2, 3)


MODES: tuple[Mode, ...] = (
    Mode("sync-g1", {}, num_workers=1),
    Mode("sync-g2", {"grads_to_wait": 2}, num_workers=2, versions="grads_to_wait"),
    Mode("async", {"use_async": True}, num_workers=2),
    Mode("ssp", {"use_async": True, "staleness_bound": 2}, num_workers=2),
    Mode("push-steps", {"use_async": True, "push_steps": 2}, num_workers=1, versions="push_steps"),
    Mode("overlap", {"use_async": True, "overlap_communication": True}, num_workers=1),
    Mode("embedding", {}, num_workers=1, model=DEEPFM, num_ps=(2, 3)),
)
MODE_NAMES = tuple(mode.name for mode in MODES)


@dataclass(frozen=True)
class Plan:
    """Everything a seed decides about its job except the faults (schedule.py)."""

    seed: int
    mode: Mode
    store: str
    num_ps: int
    epochs: int
    job: str = field(default="")

    @property
    def job_name(self) -> str:
        return self.job or f"chaos-{self.seed}"


def mode_named(name: str) -> Mode:
    for mode in MODES:
        if mode.name == name:
            return mode
    raise SystemExit(f"no mode {name!r}: choose one of {', '.join(MODE_NAMES)}")


def shard_batches(train_dir: str, model: Model) -> list[int]:
    """The minibatches of each task of one epoch: every task is cut into minibatches on its own."""
    files = [(path, count_records(path)) for path in resolve_data_files(train_dir)]
    return [math.ceil(s.records / model.minibatch) for s in make_shards(files, model.records_per_task)]


def records_per_epoch(train_dir: str) -> int:
    return sum(count_records(path) for path in resolve_data_files(train_dir))


def version_bounds(mode: Mode, batches: list[int], epochs: int) -> tuple[int, int]:
    """The final model version a job that applied every record exactly once may end at.

    One version per applied batch (sync with grads_to_wait 1, async, SSP, overlap: every
    batch is one push and every push one version), whatever the faults and worker count.
    ``--push_steps N`` pushes the mean of up to N batches of one task, so a task requeued in two
    pieces may take one push more: at least the fault-free count, at most one per batch.
    ``--grads_to_wait 2`` averages two pushes, or one while the other worker is away.
    """
    total = epochs * sum(batches)
    if mode.versions == "push_steps":
        steps = int(mode.flags["push_steps"])
        return epochs * sum(math.ceil(b / steps) for b in batches), total
    if mode.versions == "grads_to_wait":
        return math.ceil(total / int(mode.flags["grads_to_wait"])), total
    return total, total


def prepare_data(model: Model, directory: str) -> str:
    """The model's training and validation data under ``directory`` (made once, then reused)."""
    out = os.path.join(directory, model.name)
    if os.path.isdir(os.path.join(out, "train")):
        return out
    if model is DIGITS:
        subprocess.run([sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"), "--output", out],
                       check=True, capture_output=True)
    else:
        sys.path.insert(0, MODEL_ZOO)
        try:
            from deepctr.generate_data import generate
        finally:
            sys.path.remove(MODEL_ZOO)
        generate(out, train_records=2000, test_records=500)
    return out


def train_command(plan: Plan, data: str, etcd_endpoint: str = "", training_data: str = "") -> list[str]:
    """``training_data``: a stream's ``kafka://`` address (stream.py); the data's files without."""
    model = plan.mode.model
    flags: dict[str, object] = {
        "model_zoo": MODEL_ZOO, "model_def": model.model_def,
        "training_data": training_data or os.path.join(data, "train"), "validation_data": os.path.join(data, "test"),
        "minibatch_size": model.minibatch, "records_per_task": model.records_per_task,
        "num_epochs": plan.epochs, "num_workers": plan.mode.num_workers, "num_ps": plan.num_ps,
        "checkpoint_dir": "ckpt", "checkpoint_steps": CHECKPOINT_STEPS, "job_name": plan.job_name,
        # A frozen worker's task comes back after this; the job's own default (600 s) outlives a run.
        "task_timeout": 20,
        **plan.mode.flags,
    }
    if etcd_endpoint:
        flags["etcd_endpoints"] = etcd_endpoint
    args = [sys.executable, "-m", "elasticdl", "train"]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args
