"""The ``replicas`` case: what ``--ps_replicas 1`` costs in throughput (docs/replicas.md).

The same ElasticDL job with R = 0 and R = 1, 2 workers and 2 PS (async: the consistency of the
``training`` case's 2-worker rows), on DeepFM (its tables on the PS: lookups that create rows
are forwarded too) and on the dense model of 5M parameters (each push forwards 20 MB to the
backup). Runs are the ``training`` case's (benchmarks/training.py, one process per repetition,
model and competitor, the order rotated); the ratio is R = 1 over R = 0, run back to back.
Target (issue 26): DeepFM with R = 1 at 0.8x R = 0 or more (``TARGETS["replicas_vs_none"]``).
"""

from __future__ import annotations

import argparse

from benchmarks.common import median, paired_ratios

BASE = {"competitor": "elasticdl", "num_workers": 2, "num_ps": 2, "use_async": True}
COMPETITORS = [("replicas_0", dict(BASE, ps_replicas=0)), ("replicas_1", dict(BASE, ps_replicas=1))]
LABELS = {"replicas_0": "ElasticDL 2 workers + 2 PS (--use_async), no replicas",
          "replicas_1": "ElasticDL 2 workers + 2 PS (--use_async --ps_replicas 1)"}
# By --quick; the runner's --models keeps some of them (one model at a time: deepfm_1m_ids).
MODELS = {True: "dense_tiny,deepfm_10k_ids", False: "dense5m,deepfm_1m_ids"}


def run_replicas(args, out_dir: str) -> dict:
    from benchmarks.runner import run_training

    chosen = [m for m in MODELS[args.quick].split(",") if not args.models or m in args.models.split(",")]
    own = argparse.Namespace(**{**vars(args), "models": ",".join(chosen), "competitors": ""})
    return run_training(own, out_dir, COMPETITORS)


def replica_rows(result: dict, threshold: float) -> tuple[list[dict], list[dict]]:
    """A row per model and R (examples/s; R = 1 with its ratio to R = 0), and the DeepFM target."""
    from benchmarks.runner import _status_row, _target

    rows, targets = [], []
    for model, comps in result["runs"].items():
        eps = {c: [r["examples_per_s"] if r else None for r in runs] for c, runs in comps.items()}
        if not any(v is not None for runs in eps.values() for v in runs):
            rows.append(_status_row("replicas", model, "error: see errors"))
            continue
        ratio = median(paired_ratios(eps["replicas_1"], eps["replicas_0"]))
        for comp, runs in eps.items():
            rows.append({"case": "replicas", "model": model, "competitor": comp, "metric": "examples/s",
                         "median": median(runs), "runs": runs,
                         "ttfg_s": median([r["ttfg_s"] if r else None for r in comps[comp]]),
                         "ratio": ratio if comp == "replicas_1" else None,
                         "ratio_to": "replicas_0" if comp == "replicas_1" else ""})
        if model.startswith("deepfm"):
            targets.append(_target(f"replicas {model}: replicas_1 / replicas_0", ratio, threshold))
    return rows, targets
