"""What staleness does to a job, summarised from the PS counters.

Each PS counts pushes accepted, pushes rejected as stale, and the staleness (PS version
at arrival - the version the gradient was computed on) of every gradient it applied, and
the records those gradients came from. The master turns those counters into a per-epoch and a
whole-job summary; records per push is the effective batch (``--minibatch_size``, times
``--push_steps`` with accumulated pushes, less at a task's end where fewer batches are pushed).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

# Pushes refused as stale above this share of all pushes make an epoch's line worth an INFO
# line: each was a batch's gradients computed for nothing (issue 29's target: 5%).
STALE_WASTE_WORTH_A_LINE = 0.05


@dataclass
class StalenessSummary:
    pushes_accepted: int = 0
    pushes_rejected_stale: int = 0
    pushes_rejected_invalid: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # staleness -> applied gradients
    blocked_seconds: float = 0.0  # workers waiting for the staleness bound, summed
    records_applied: int = 0  # summed over the PS, as pushes_accepted is
    gradients_refused: int = 0  # by the PS's gradient guard: beyond float32, or far beyond the running norm

    @property
    def records_per_push(self) -> float:
        """The effective batch: records whose gradients one accepted push carried, on average."""
        return self.records_applied / self.pushes_accepted if self.pushes_accepted else 0.0

    @property
    def rejected_rate(self) -> float:
        total = self.pushes_accepted + self.pushes_rejected_stale
        return self.pushes_rejected_stale / total if total else 0.0

    @property
    def mean_staleness(self) -> float:
        count = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / count if count else 0.0

    @property
    def noteworthy(self) -> bool:
        """Worth a line of its own at an epoch end: pushes refused as invalid, more than 5% of
        the pushes rejected as stale (wasted computations), or workers held back by the
        staleness bound for a second or more. (An epoch without any of these is only in the
        job's summary.)"""
        return bool(self.pushes_rejected_invalid or self.gradients_refused
                    or self.rejected_rate > STALE_WASTE_WORTH_A_LINE or self.blocked_seconds >= 1.0)

    def minus(self, earlier: StalenessSummary) -> StalenessSummary:
        """The counts since ``earlier`` (counters only grow)."""
        hist = collections.Counter(self.staleness)
        hist.subtract(earlier.staleness)
        return StalenessSummary(
            self.pushes_accepted - earlier.pushes_accepted,
            self.pushes_rejected_stale - earlier.pushes_rejected_stale,
            self.pushes_rejected_invalid - earlier.pushes_rejected_invalid,
            {k: v for k, v in sorted(hist.items()) if v > 0},
            self.blocked_seconds - earlier.blocked_seconds,
            self.records_applied - earlier.records_applied,
            self.gradients_refused - earlier.gradients_refused,
        )

    def to_dict(self) -> dict:
        return {
            "pushes_accepted": self.pushes_accepted,
            "pushes_rejected_stale": self.pushes_rejected_stale,
            "pushes_rejected_invalid": self.pushes_rejected_invalid,
            "rejected_stale_rate": round(self.rejected_rate, 4),
            "mean_staleness": round(self.mean_staleness, 3),
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "seconds_blocked_by_bound": round(self.blocked_seconds, 3),
            "records_per_push": round(self.records_per_push, 2),
            "gradients_refused": self.gradients_refused,
        }

    def describe(self, stale_remedy: str = "") -> str:
        """The counts in a line; ``stale_remedy`` (ConsistencySection.stale_remedy) ends it when
        pushes were refused as stale: why, in this mode, and the flag that changes it."""
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.staleness.items())) or "-"
        blocked = f"; workers blocked by the bound {self.blocked_seconds:.2f}s" if self.blocked_seconds else ""
        if self.pushes_rejected_stale:
            blocked += (f"; the {self.pushes_rejected_stale} stale pushes are batches computed for nothing and "
                        f"computed again ({self.rejected_rate:.1%} of the gradient computations wasted)"
                        + (f": {stale_remedy}" if stale_remedy else ""))
        if self.gradients_refused:  # the model may have stopped improving because of them
            blocked += (f"; {self.gradients_refused} gradients refused by the gradient guard (never applied: "
                        "see the PS logs; --max_gradient_norm_ratio)")
        return (
            f"pushes accepted {self.pushes_accepted}, rejected as stale {self.pushes_rejected_stale} "
            f"({self.rejected_rate:.1%}), invalid {self.pushes_rejected_invalid}; "
            f"staleness histogram {{{hist}}} (mean {self.mean_staleness:.2f}); "
            f"records per push {self.records_per_push:.1f}{blocked}"
        )


def summarize(ps_stats, blocked_seconds: float) -> StalenessSummary:
    """Counters summed over the parameter servers (each push reaches every PS)."""
    hist: collections.Counter = collections.Counter()
    summary = StalenessSummary(blocked_seconds=blocked_seconds)
    for stats in ps_stats:
        summary.pushes_accepted += stats.pushes_accepted
        summary.pushes_rejected_stale += stats.pushes_rejected_stale
        summary.pushes_rejected_invalid += stats.pushes_rejected_invalid
        hist.update(stats.staleness)
        summary.records_applied += stats.records_applied
        summary.gradients_refused += getattr(stats, "gradients_refused", 0)  # a PS of an older build: none
    summary.staleness = dict(sorted(hist.items()))
    return summary
