"""The consistency section of the job's configuration: how fresh a model a gradient must be
computed on (sync, async, stale-synchronous), and the checks across its flags
(elasticdl/config/sections.py holds the other sections; docs/consistency.md the rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from elasticdl.config.errors import ConfigError
from elasticdl.config.fields import AT_LEAST_1, flag


@dataclass
class ConsistencySection:
    """How fresh a model a gradient must be computed on: sync, async or stale-synchronous."""

    TITLE: ClassVar[str] = "Consistency"

    grads_to_wait: int = flag(
        0,
        "Sync mode: gradients gathered (and averaged) per model version; 0: one from each worker "
        "holding a training task, following the workers as they come and go (no gradient is "
        "computed on a version the others moved past).",
        commands=("train",),
    )
    use_async: bool = flag(
        False, "Apply each gradient as it arrives, without version checks.", commands=("train",)
    )
    staleness_bound: int = flag(
        0,
        "Async only: stale-synchronous parallel; a worker waits while it is more than this "
        "many steps ahead of the slowest worker holding a task (0: no bound).",
        commands=("train",),
    )
    get_model_steps: int = flag(
        1,
        "Async only: pull the model every N steps, applying the worker's own gradients "
        "locally in between.",
        commands=("train",),
        bounds=AT_LEAST_1,
    )
    push_steps: int = flag(
        1,
        "Async only: push the mean of the gradients of every N steps (local SGD), applying "
        "each step's gradients locally in between; pulls happen after a push.",
        commands=("train",),
        bounds=AT_LEAST_1,
    )
    overlap_communication: bool = flag(
        False,
        "Async only: push each step's gradients and pull fresh parameters on a background "
        "thread while the next step computes (one exchange in flight; its gradients are one "
        "version staler).",
        commands=("train",),
    )
    sync_version_tolerance: int = flag(
        0,
        "Sync only: accept gradients computed up to K versions behind the model.",
        commands=("train",),
    )
    lr_staleness_modulation: bool = flag(
        False,
        "Divide each gradient's learning rate by its staleness (at least 1).",
        commands=("train",),
    )
    max_gradient_norm_ratio: float = flag(
        1000.0,
        "A parameter server refuses (and counts) a gradient whose norm is more than this many times "
        "the running norm of the gradients it applied (0: no such check; a gradient beyond float32 "
        "is always refused). The report's staleness.gradients_refused counts them.",
        commands=("train",),
    )

    @property
    def description(self) -> str:
        if not self.use_async:
            tolerance = f", version tolerance {self.sync_version_tolerance}" if self.sync_version_tolerance else ""
            per_version = self.grads_to_wait or "one per worker holding a task"
            return f"sync SGD, grads_to_wait={per_version}{tolerance}"
        pull = f", pull every {self.get_model_steps} steps" if self.get_model_steps > 1 else ""
        push = f", push every {self.push_steps} steps" if self.push_steps > 1 else ""
        overlap = ", communication overlapped with compute" if self.overlap_communication else ""
        if self.staleness_bound:
            return f"stale-synchronous parallel, staleness bound {self.staleness_bound}" + push + overlap
        return "async SGD" + pull + push + overlap

    @property
    def stale_remedy(self) -> str:
        """Why pushes are refused as stale in this mode and the flag that changes it: the
        consistency lines of the telemetry end with it when any were (master/telemetry.py)."""
        if self.use_async:
            return ("async refuses only gradients computed on a model more than 10,000 versions ahead of "
                    "the PS (it came back from an older checkpoint); no flag changes that")
        if self.grads_to_wait:
            return (f"--grads_to_wait={self.grads_to_wait} closes a version before every worker's gradient is "
                    "in and refuses the rest: --grads_to_wait 0 (the default) waits for one per worker "
                    "holding a task, or --sync_version_tolerance 1 takes gradients one version old")
        if self.sync_version_tolerance:
            return (f"gradients more than --sync_version_tolerance={self.sync_version_tolerance} versions old "
                    "are refused: raise it")
        return ("with one gradient per worker, a refusal follows a worker that came or went mid-version: "
                "--sync_version_tolerance 1 takes gradients one version old")

    def validate(self) -> None:
        """The combinations that cannot work (each flag's own range: JobConfig.validate)."""
        if self.use_async:
            conflicts = [
                # 1 too: an async PS applies every gradient as its own version (and 1 was the default).
                f"--grads_to_wait={self.grads_to_wait}" if self.grads_to_wait > 1 else "",
                f"--sync_version_tolerance={self.sync_version_tolerance}" if self.sync_version_tolerance else "",
            ]
            conflicts = [c for c in conflicts if c]
            if conflicts:
                raise ConfigError(
                    f"{' and '.join(conflicts)} only apply to sync training, but --use_async is set: "
                    "drop them or drop --use_async."
                )
            if self.overlap_communication and self.push_steps > 1:
                raise ConfigError(
                    f"--overlap_communication and --push_steps={self.push_steps} cannot be combined: an "
                    "accumulated push already leaves its workers computing between exchanges; drop one."
                )
            return
        conflicts = [
            f"--staleness_bound={self.staleness_bound}" if self.staleness_bound else "",
            f"--get_model_steps={self.get_model_steps}" if self.get_model_steps != 1 else "",
            f"--push_steps={self.push_steps}" if self.push_steps != 1 else "",
            "--overlap_communication" if self.overlap_communication else "",
        ]
        conflicts = [c for c in conflicts if c]
        if conflicts:
            raise ConfigError(
                f"{' and '.join(conflicts)} only apply to async training: add --use_async "
                "(stale-synchronous parallel is --use_async with --staleness_bound)."
            )
        if self.lr_staleness_modulation and not self.sync_version_tolerance:
            raise ConfigError(
                "--lr_staleness_modulation has no effect in strict sync training (every applied "
                "gradient has staleness 0): add --use_async or --sync_version_tolerance."
            )
