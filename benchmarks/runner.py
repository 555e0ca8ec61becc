"""The benchmark suite: runs every case, prints a table of medians and ratios, writes JSON
(and a PNG chart when matplotlib is importable).

    python -m benchmarks                      # every case, 3 repetitions
    python -m benchmarks --quick              # tiny sizes, 1 repetition (the smoke test)
    python -m benchmarks --cases ps_data_plane --reps 5

Each competitor runs in fresh processes with the same model, data, minibatch size and
thread budget; competitors are interleaved (one run of each per repetition, the order
rotated every repetition) so that machine noise spreads over all of them. Figures are
medians over repetitions; a ratio is the median of the per-repetition ratios of runs
made back to back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import (
    BENCH_MODEL_ZOO,
    REPO,
    ChildFailed,
    cores,
    machine_info,
    median,
    paired_ratios,
    run_child,
)

CASES = ("training", "ps_data_plane", "embedding", "elastic_recovery", "parquet_s3", "replicas", "endless_ids")
# Cases run only when named (--cases): not in the default suite or its smoke test.
OPT_IN_CASES = ("stream",)

# (row name, driver spec). ElasticDL 2w runs async (--use_async), the consistency of
# ParameterServerStrategy; its default, sync SGD with one gradient per worker per version, is
# shown too, and the former default (grads_to_wait=1, which refused a third to a half of the
# pushes as stale).
COMPETITORS = [
    ("keras_fit", {"competitor": "keras_fit", "num_workers": 1}),
    ("elasticdl_1w1ps", {"competitor": "elasticdl", "num_workers": 1}),
    ("elasticdl_2w1ps", {"competitor": "elasticdl", "num_workers": 2, "use_async": True}),
    ("elasticdl_2w1ps_sync", {"competitor": "elasticdl", "num_workers": 2}),
    ("elasticdl_2w1ps_sync_gtw1", {"competitor": "elasticdl", "num_workers": 2, "grads_to_wait": 1}),
    # The seed's accumulated pushes (local SGD): one push of the mean of 4 batches.
    ("elasticdl_1w1ps_push4", {"competitor": "elasticdl", "num_workers": 1, "use_async": True, "push_steps": 4}),
    # Dense gradients and parameters in bfloat16 on the wire (--wire_dtype), the PS in float32.
    ("elasticdl_1w1ps_bf16", {"competitor": "elasticdl", "num_workers": 1, "wire_dtype": "bfloat16"}),
    # Large dense pulls and pushes as raw frames on a socket beside gRPC (--tensor_transport tcp).
    ("elasticdl_1w1ps_tcp", {"competitor": "elasticdl", "num_workers": 1, "tensor_transport": "tcp"}),
    # Communication overlapped with compute (async), beside async without it at 1 worker.
    ("elasticdl_1w1ps_async", {"competitor": "elasticdl", "num_workers": 1, "use_async": True}),
    ("elasticdl_1w1ps_overlap", {"competitor": "elasticdl", "num_workers": 1, "use_async": True,
                                 "overlap_communication": True}),
    ("elasticdl_2w1ps_overlap", {"competitor": "elasticdl", "num_workers": 2, "use_async": True,
                                 "overlap_communication": True}),
    ("pss_1w1ps", {"competitor": "pss", "num_workers": 1}),
    ("pss_2w1ps", {"competitor": "pss", "num_workers": 2}),
    # Issue 28's collaborative-filtering acceptance: 2 workers + 2 PS against model.fit.
    ("elasticdl_2w2ps", {"competitor": "elasticdl", "num_workers": 2, "num_ps": 2}),
    # Issue 28's sliced dense variables: the 5M MLP's five 3-4 MiB kernels one slice per PS
    # (--slice_dense_above_mb 1), against 1 PS and 2 PS placing whole variables by name hash.
    ("elasticdl_2w2ps_sliced", {"competitor": "elasticdl", "num_workers": 2, "num_ps": 2,
                                "slice_dense_above_mb": 1.0}),
]
# Competitors that run only on some models (every other competitor runs on every model).
ONLY_ON = {"elasticdl_2w2ps": ("collab_50k_users", "dense5m"), "elasticdl_2w2ps_sliced": ("dense5m",)}
# Informational; --quick leaves them out to stay fast.
QUICK_SKIPS = ("elasticdl_2w2ps", "elasticdl_2w2ps_sliced", "elasticdl_2w1ps_sync", "elasticdl_2w1ps_sync_gtw1", "elasticdl_1w1ps_bf16", "elasticdl_1w1ps_tcp", "elasticdl_1w1ps_async",
               "elasticdl_1w1ps_overlap", "elasticdl_2w1ps_overlap")
COMPETITOR_LABELS = {
    "keras_fit": "Keras model.fit, 1 process",
    "elasticdl_1w1ps": "ElasticDL 1 worker + 1 PS (default: sync)",
    "elasticdl_2w1ps": "ElasticDL 2 workers + 1 PS (--use_async)",
    "elasticdl_2w1ps_sync": "ElasticDL 2 workers + 1 PS (default: sync, one gradient per worker per version)",
    "elasticdl_2w1ps_sync_gtw1": "ElasticDL 2 workers + 1 PS (sync, --grads_to_wait 1: the former default)",
    "elasticdl_1w1ps_push4": "ElasticDL 1 worker + 1 PS (--use_async --push_steps 4)",
    "elasticdl_1w1ps_bf16": "ElasticDL 1 worker + 1 PS (default: sync; --wire_dtype bfloat16)",
    "elasticdl_1w1ps_tcp": "ElasticDL 1 worker + 1 PS (default: sync; --tensor_transport tcp)",
    "elasticdl_1w1ps_async": "ElasticDL 1 worker + 1 PS (--use_async)",
    "elasticdl_1w1ps_overlap": "ElasticDL 1 worker + 1 PS (--use_async --overlap_communication)",
    "elasticdl_2w1ps_overlap": "ElasticDL 2 workers + 1 PS (--use_async --overlap_communication)",
    "pss_1w1ps": "ParameterServerStrategy 1 worker + 1 PS",
    "pss_2w1ps": "ParameterServerStrategy 2 workers + 1 PS",
    "elasticdl_2w2ps": "ElasticDL 2 workers + 2 PS (default: sync)",
    "elasticdl_2w2ps_sliced": "ElasticDL 2 workers + 2 PS (default: sync; --slice_dense_above_mb 1)",
}

WARMUP_BATCHES = 8  # one ElasticDL task (--num_minibatches_per_task 8)
QUICK_WARMUP_BATCHES = 2


# ElasticDL flags of the DeepFM jobs: every keras.layers.Embedding becomes a PS table. The
# default threshold (2 MiB) already swaps both 1M-id tables; 0 swaps the 10k-id tables of
# --quick as well, so that the smoke test runs the same code path.
PS_TABLES = {"embedding_swap_threshold_mb": 0.0}


def training_models(quick: bool) -> dict[str, dict]:
    """Model name -> what the drivers need, minus the data paths (filled in later)."""
    if quick:  # two tiny models: the smoke test has 90 s for everything
        return {
            "dense_tiny": {"data": "dense_quick", "batch_size": 32, "epochs": 2,
                           "model_params": "input_dim=32;width=64;depth=2", "input_dim": 32},
            "deepfm_10k_ids": {"data": "ctr_quick", "batch_size": 64, "epochs": 1,
                               "model_params": "vocabulary=10000", "job_flags": PS_TABLES},
        }
    return {
        "digits": {"data": "digits", "batch_size": 64, "epochs": 20},
        "dense5m": {"data": "dense", "batch_size": 64, "epochs": 2, "model_params": "", "input_dim": 768},
        # The zoo's CTR minibatch (model_zoo/deepctr); 40,000 records x 2 epochs = 314 minibatches.
        "deepfm_1m_ids": {"data": "ctr", "batch_size": 256, "epochs": 2,
                          "model_params": "vocabulary=1000000", "job_flags": PS_TABLES},
        # keras-io collaborative filtering (L2-regularized 50-wide Embeddings), its batch size;
        # every table on the PS (the 8,000-movie table is below the default threshold).
        "collab_50k_users": {"data": "ratings", "batch_size": 64, "epochs": 1, "job_flags": PS_TABLES,
                             "competitors": ("keras_fit", "elasticdl_2w2ps")},
    }


DATASETS = {
    "digits": {"kind": "digits"},
    "digits_x10": {"kind": "digits", "copies": 10},  # the elastic job: 14,370 records per epoch
    "dense": {"kind": "dense", "records": 4096, "dim": 768},
    "dense_quick": {"kind": "dense", "records": 768, "dim": 32},
    "ctr": {"kind": "ctr", "records": 40_000, "vocabulary": 1_000_000},
    "ctr_quick": {"kind": "ctr", "records": 1024, "vocabulary": 10_000},
    "ratings": {"kind": "ratings", "records": 90_000, "users": 50_000, "movies": 8_000},  # keras-io's 90% split
}
MODEL_DEFS = {
    "digits": (os.path.join(REPO, "model_zoo"), "digits.digits_functional.custom_model"),
    "dense5m": (BENCH_MODEL_ZOO, "dense.dense_mlp.custom_model"),
    "dense_tiny": (BENCH_MODEL_ZOO, "dense.dense_mlp.custom_model"),
    "deepfm_1m_ids": (BENCH_MODEL_ZOO, "deepfm.deepfm_keras.custom_model"),
    "deepfm_10k_ids": (BENCH_MODEL_ZOO, "deepfm.deepfm_keras.custom_model"),
    "collab_50k_users": (BENCH_MODEL_ZOO, "collab.recommender.custom_model"),
}
DATAPLANE_SIZES = {
    # 5M floats: the 20 MB of the dense benchmark model, the data plane target.
    False: {"sizes": [["5M", 5_000_000], ["10M", 10_000_000], ["50M", 50_000_000]],
            "rounds": {"5M": 10, "10M": 6, "50M": 3}},
    True: {"sizes": [["1M", 1_000_000], ["4M", 4_000_000]], "rounds": {"1M": 2, "4M": 1}},
}
# Embedding tables on one PS: a fresh PS per size; batches of 8,192 ids (issue 28's figure: a
# PS serving several workers' minibatches). Bytes per row: a table of 1M rows in a fresh process
# (the quick suite's 100k still dwarfs the allocator's noise).
EMBEDDING_SIZES = {
    False: {"tables": [["100k", 100_000], ["1M", 1_000_000]], "batch": 8192, "seconds": 3.0,
            "memory_tables": [["1M", 1_000_000]]},
    True: {"tables": [["1k", 1_000], ["10k", 10_000]], "batch": 1024, "seconds": 0.3,
           "memory_tables": [["100k", 100_000]]},
}
# The elastic job: digits 10 times over, tasks of 8 minibatches of 32: 56 tasks per epoch of
# 5-15 s, so that a worker is nearly always inside a task (at an epoch's end a worker waits
# for the last tasks of the others); far more epochs than it runs before it is interrupted.
RECOVERY_JOB = {
    False: {"minibatch_size": 32, "minibatches_per_task": 8, "epochs": 30, "settle_s": 2.0},
    True: {"minibatch_size": 32, "minibatches_per_task": 8, "epochs": 30, "settle_s": 0.5},
}
# Parquet on the moto S3 endpoint (benchmarks/parquet_s3.py): rows, files, rows per row group (= per task).
PARQUET_S3 = {
    False: {"rows": 1_000_000, "files": 2, "row_group_rows": 65_536},
    True: {"rows": 50_000, "files": 2, "row_group_rows": 8_192},
}
# The targets of issue 18 (docs/benchmarks.md): ElasticDL / ParameterServerStrategy per model
# family and worker count, / model.fit on the dense model, absolute data plane and start-up.
VS_PSS = {"deepfm": {"1w": 3.0, "2w": 3.0}, "digits": {"1w": 1.3, "2w": 1.3}, "dense": {"1w": 1.2, "2w": 1.5}}
TARGETS = {
    "vs_pyarrow": 0.8,
    "vs_fit": 0.75,  # dense, 1 worker, sync
    "vs_fit_push": 0.9,  # dense, 1 worker, --push_steps 4
    "vs_raw_grpc": 0.6,
    "data_plane_mb_per_s": 2000.0,  # 20 MB round trips (the 5M row; every size is held to it)
    "first_gradient_s": 3.0,  # ElasticDL 1 worker: from the job's start to the first applied gradient
    "scale_up_s": 3.0,  # a new worker's first gradient after `elasticdl scale`
    # 2 workers, sync, default flags: pushes refused as stale, % of all pushes (wasted computations).
    "rejected_stale_pct": 5.0,
    # Issue 28: the PS core's lookup + update of ids already held / new ids (rows created), the
    # same over gRPC as a ratio of the core, and the resident bytes of a row / its physical size.
    "embedding_held_ids_per_s": 5_000_000.0,
    "embedding_new_ids_per_s": 2_000_000.0,
    "embedding_grpc_vs_core": 0.8,
    "embedding_bytes_vs_physical": 1.3,  # at most
    "replicas_vs_none": 0.8,  # DeepFM, 2 workers, 2 PS: --ps_replicas 1 / none (benchmarks/replicas.py)
    "replica_failover_s": 1.0,  # --ps_replicas 1: from a PS SIGKILL to training again (elastic_recovery)
    "collab_vs_fit": 1.5,  # keras-io collaborative filtering, 2 workers + 2 PS / model.fit
    # Issue 28: dense5m, 2 workers, its kernels sliced over 2 PS / the same on 1 PS (both sync).
    "sliced_2ps_vs_1ps": 1.0,
    # Issue 28's endless-id run (benchmarks/endless_ids.py): a ttl-bounded table's PS memory after
    # the first quarter grows by at most this fraction, at the unbounded job's AUC within this.
    "endless_rss_growth": 0.10,
    "endless_auc_gap": 0.005,
}
# The default-flag sync jobs held to rejected_stale_pct (digits and DeepFM; issue 29).
REJECTED_STALE_MODELS = ("digits", "deepfm")


def vs_pss_target(model: str, competitor: str) -> float:
    family = next((f for f in VS_PSS if model.startswith(f)), None)
    if family is None:
        return 1.0
    return VS_PSS[family]["2w" if "_2w" in competitor else "1w"]


def log(message: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- case: training


def run_training(args, out_dir: str, competitors_of: list | None = None) -> dict:
    """``competitors_of``: another list than COMPETITORS (the replicas case's)."""
    from benchmarks.data import prepare

    models = training_models(args.quick)
    if args.models:
        models = {k: v for k, v in models.items() if k in args.models.split(",")}
    data = prepare(os.path.join(out_dir, "data"), {m["data"]: DATASETS[m["data"]] for m in models.values()})
    model_cfgs = {}
    for name, m in models.items():
        zoo, model_def = MODEL_DEFS[name]
        d = data[m["data"]]
        model_cfgs[name] = {
            "name": name, "model_zoo": zoo, "model_def": model_def, "model_params": m.get("model_params", ""),
            "data_dir": d["dir"], "files": d["files"], "records": d["records"],
            "batch_size": m["batch_size"], "epochs": m["epochs"], "job_flags": m.get("job_flags", {}),
        }
    env = {"BENCH_DENSE_INPUT_DIM": str(next((m["input_dim"] for m in models.values() if "input_dim" in m), 768))}
    competitors = [(n, c) for n, c in (competitors_of or COMPETITORS)
                   if not args.competitors or n in args.competitors.split(",")]
    budget = args.threads or cores()

    def runs_on(model: str, comp: str) -> bool:
        only = models[model].get("competitors")
        return comp in only if only is not None else model in ONLY_ON.get(comp, (model,))

    raw: dict = {m: {c: [None] * args.reps for c, _ in competitors if runs_on(m, c)} for m in model_cfgs}
    errors: list[str] = []

    def spec_of(comp: dict, rep: int, comp_name: str, names: list[str]) -> dict:
        return dict(comp, threads=budget, warmup_batches=QUICK_WARMUP_BATCHES if args.quick else WARMUP_BATCHES, tag=f"r{rep}-{comp_name}", env=env,
                    models=[model_cfgs[n] for n in names])

    def one(item):
        rep, runs, names = item  # runs: [(competitor name, competitor spec)], sharing one process
        label = "+".join(c for c, _ in runs)
        log(f"training rep {rep + 1}/{args.reps}: {label} on {', '.join(names)}")
        specs = [spec_of(comp, rep, comp_name, names) for comp_name, comp in runs]
        spec = specs[0] if len(specs) == 1 else {"sequence": specs, "env": env}
        try:
            result = run_child("benchmarks.training", spec, cwd=out_dir, timeout=args.timeout,
                               log_path=os.path.join(out_dir, "logs", f"r{rep}-{label}-{'-'.join(names)}.log"))
        except ChildFailed as err:
            errors.append(f"{label} on {', '.join(names)} (rep {rep + 1}): {err}")
            log(str(err))
            return
        for (comp_name, _), res in zip(runs, result["sequence"] if len(specs) > 1 else [result]):
            for n in names:
                raw[n][comp_name][rep] = res[n]
                log(f"  {comp_name} {n}: {res[n]['examples_per_s']:.0f} examples/s, "
                    f"first gradient after {_fmt(res[n]['ttfg_s'])} s")

    if args.quick:
        # Smoke test only: keras_fit and the ElasticDL runs share one process, the PSS
        # runs go alongside (two processes at a time); the figures are not comparable.
        names = list(model_cfgs)
        shared = [(n, c) for n, c in competitors if c["competitor"] != "pss" and n not in QUICK_SKIPS]
        plan = [(0, shared, names)] if shared else []
        plan += [(0, [(n, c)], names) for n, c in competitors if c["competitor"] == "pss"]
        for per_model in raw.values():
            for n in QUICK_SKIPS:
                per_model.pop(n, None)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, plan))
    else:
        # One process per (repetition, model, competitor); competitors interleaved and
        # their order rotated every repetition.
        for rep in range(args.reps):
            shift = rep % len(competitors)
            order = competitors[shift:] + competitors[:shift]
            for model_name in model_cfgs:
                for comp_name, comp in order:
                    if runs_on(model_name, comp_name):
                        one((rep, [(comp_name, comp)], [model_name]))
    return {"models": {n: {k: v for k, v in c.items() if k != "files"} for n, c in model_cfgs.items()},
            "threads": budget, "runs": raw, "errors": errors,
            "datasets": {k: {"source": v["source"], "records": v["records"]} for k, v in data.items()}}


# ---------------------------------------------------------------- case: PS data plane


def run_dataplane(args, out_dir: str) -> dict:
    sizes = DATAPLANE_SIZES[args.quick]
    spec = {"sizes": sizes["sizes"], "rounds": sizes["rounds"], "reps": args.reps,
            "workdir": os.path.join(out_dir, "dataplane")}
    log(f"ps_data_plane: {', '.join(s for s, _ in sizes['sizes'])} floats, {args.reps} repetitions")
    try:
        result = run_child("benchmarks.dataplane", spec, cwd=out_dir, timeout=args.timeout,
                           log_path=os.path.join(out_dir, "logs", "dataplane.log"))
        return {"runs": result, "errors": []}
    except ChildFailed as err:
        log(str(err))
        return {"runs": {}, "errors": [str(err)]}


# ---------------------------------------------------------------- case: embedding


def run_embedding(args, out_dir: str) -> dict:
    sizes = EMBEDDING_SIZES[args.quick]
    spec = {**sizes, "reps": args.reps, "workdir": os.path.join(out_dir, "embedding")}
    log(f"embedding: tables of {', '.join(label for label, _ in sizes['tables'])} ids, {args.reps} repetitions")
    try:
        result = run_child("benchmarks.embedding_memory", spec, cwd=out_dir, timeout=args.timeout,
                           log_path=os.path.join(out_dir, "logs", "embedding.log"))
        return {"runs": result["tables"], "memory": result.get("memory", {}), "batch": sizes["batch"], "errors": []}
    except ChildFailed as err:
        log(str(err))
        return {"runs": {}, "errors": [str(err)]}


# ---------------------------------------------------------------- case: elastic recovery


def run_recovery(args, out_dir: str) -> dict:
    from benchmarks.data import prepare

    data = prepare(os.path.join(out_dir, "data"), {"digits_x10": DATASETS["digits_x10"]})["digits_x10"]
    spec = {**RECOVERY_JOB[args.quick], "reps": args.reps, "data_dir": data["dir"], "kill_attempts": 3,
            "timeout": 180.0, "workdir": os.path.join(out_dir, "elastic_recovery")}
    log(f"elastic_recovery: digits, {args.reps} x 2 jobs (scale 1 -> 2 workers, then kill a worker; kill a PS)")
    try:
        result = run_child("benchmarks.elastic_recovery", spec, cwd=out_dir, timeout=args.timeout,
                           log_path=os.path.join(out_dir, "logs", "elastic_recovery.log"))
    except ChildFailed as err:
        log(str(err))
        return {"runs": [], "errors": [str(err)]}
    for rep, r in enumerate(result["runs"]):
        if r:
            log(f"  rep {rep + 1}: scale-up {r['scale_up_s']:.2f} s, killed worker's task again "
                f"after {r['kill_worker_s']:.3f} s, training again {r['kill_ps_s']:.2f} s after a PS SIGKILL "
                f"({r['ps_records_retrained']} records trained again; "
                f"{r['kill_ps_replicas_s']:.2f} s with --ps_replicas 1)")
    return {"runs": result["runs"], "errors": result["errors"]}


# ---------------------------------------------------------------- case: Parquet on S3


def run_parquet_s3(args, out_dir: str) -> dict:
    spec = {**PARQUET_S3[args.quick], "reps": args.reps}
    log(f"parquet_s3: {spec['rows']:,} click rows in Parquet on a moto S3 server, {args.reps} repetitions")
    try:
        result = run_child("benchmarks.parquet_s3", spec, cwd=out_dir, timeout=args.timeout,
                           log_path=os.path.join(out_dir, "logs", "parquet_s3.log"))
    except ChildFailed as err:
        log(str(err))
        return {"runs": [], "errors": [str(err)]}
    return {"runs": result["runs"], "rows": spec["rows"], "bytes": result["bytes"], "errors": []}


# ---------------------------------------------------------------- table


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}" if abs(value) >= 1 else f"{value:.{digits + 1}f}"


def build_rows(results: dict) -> tuple[list[dict], list[dict]]:
    rows, targets = [], []
    training = results.get("training")
    if training is not None:
        for model, comps in training["runs"].items():
            fit = [r["examples_per_s"] if r else None for r in comps.get("keras_fit", [])]
            for comp, runs in comps.items():
                eps = [r["examples_per_s"] if r else None for r in runs]
                row = {
                    "case": "training", "model": model, "competitor": comp, "metric": "examples/s",
                    "median": median(eps), "runs": eps,
                    "ttfg_s": median([r["ttfg_s"] if r else None for r in runs]),
                    "ratio": None, "ratio_to": "",
                }
                if comp.startswith("elasticdl"):
                    pss = comps.get("pss_2w1ps" if "_2w" in comp else "pss_1w1ps")
                    if pss:
                        row["ratio"] = median(paired_ratios(eps, [r["examples_per_s"] if r else None for r in pss]))
                        row["ratio_to"] = "pss_2w1ps" if "_2w" in comp else "pss_1w1ps"
                    row["ratio_vs_fit"] = median(paired_ratios(eps, fit)) if fit else None
                elif comp.startswith("pss") and fit:
                    row["ratio_vs_fit"] = median(paired_ratios(eps, fit))
                rows.append(row)
            for comp, pss in (("elasticdl_1w1ps", "pss_1w1ps"), ("elasticdl_2w1ps", "pss_2w1ps")):
                if comp in comps and pss in comps:
                    ratio = next(r["ratio"] for r in rows if r["model"] == model and r["competitor"] == comp)
                    targets.append(_target(f"training {model}: {comp} / {pss}", ratio, vs_pss_target(model, comp)))
            for comp, key in (("elasticdl_1w1ps", "vs_fit"), ("elasticdl_1w1ps_push4", "vs_fit_push")):
                if model.startswith("dense") and comp in comps and "keras_fit" in comps:
                    ratio = next(r["ratio_vs_fit"] for r in rows if r["model"] == model and r["competitor"] == comp)
                    targets.append(_target(f"training {model}: {comp} / keras_fit", ratio, TARGETS[key]))
            if model.startswith("collab") and "elasticdl_2w2ps" in comps and "keras_fit" in comps:
                ratio = next(r["ratio_vs_fit"] for r in rows if r["model"] == model and r["competitor"] == "elasticdl_2w2ps")
                targets.append(_target(f"training {model}: elasticdl_2w2ps / keras_fit", ratio, TARGETS["collab_vs_fit"]))
            if "elasticdl_2w2ps_sliced" in comps and "elasticdl_2w1ps_sync" in comps:
                ratio = median(paired_ratios(*([r["examples_per_s"] if r else None for r in comps[c]]
                                               for c in ("elasticdl_2w2ps_sliced", "elasticdl_2w1ps_sync"))))
                targets.append(_target(f"training {model}: elasticdl_2w2ps_sliced / elasticdl_2w1ps_sync", ratio,
                                       TARGETS["sliced_2ps_vs_1ps"]))
            targets += _rejected_stale(model, comps, rows)
            if "elasticdl_1w1ps" in comps:
                ttfg = next(r["ttfg_s"] for r in rows if r["model"] == model and r["competitor"] == "elasticdl_1w1ps")
                targets.append(_target(f"training {model}: elasticdl_1w1ps first gradient", ttfg,
                                       TARGETS["first_gradient_s"], unit="s"))
    dataplane = results.get("ps_data_plane")
    if dataplane is not None:
        for size, runs in dataplane["runs"].items():
            if not isinstance(runs, dict):
                continue  # e.g. wall_s
            raw = [r["mb_per_s"] for r in runs["raw_grpc"]]
            edl = [r["mb_per_s"] for r in runs["elasticdl"]]
            tcp = [r["mb_per_s"] for r in runs.get("raw_tcp", [])]
            if tcp:  # the physical reference: no gRPC, no framing, one copy into a ready buffer
                rows.append({"case": "ps_data_plane", "model": f"{size} float32", "competitor": "raw_tcp_socket",
                             "metric": "MB/s", "median": median(tcp), "runs": tcp, "ratio": None, "ratio_to": ""})
            rows.append({"case": "ps_data_plane", "model": f"{size} float32", "competitor": "raw_grpc_echo",
                         "metric": "MB/s", "median": median(raw), "runs": raw, "ratio": None, "ratio_to": ""})
            ratio = median(paired_ratios(edl, raw))
            stream = [r["mb_per_s"] for r in runs.get("raw_grpc_stream", [])]
            if stream:
                rows.append({"case": "ps_data_plane", "model": f"{size} float32", "competitor": "raw_grpc_stream_1MB",
                             "metric": "MB/s", "median": median(stream), "runs": stream, "ratio": None,
                             "ratio_to": ""})
            rows.append({
                "case": "ps_data_plane", "model": f"{size} float32", "competitor": "elasticdl_ps",
                "metric": "MB/s", "median": median(edl), "runs": edl, "ratio": ratio, "ratio_to": "raw_grpc_echo",
                "pull_mb_per_s": median([r["pull_mb_per_s"] for r in runs["elasticdl"]]),
                "push_mb_per_s": median([r["push_mb_per_s"] for r in runs["elasticdl"]]),
                "ratio_vs_stream": median(paired_ratios(edl, stream)) if stream else None,
                "ratio_vs_tcp": median(paired_ratios(edl, tcp)) if tcp else None,
            })
            # bf16: float32 model bytes per second, half of them on the wire; tcp: raw frames.
            for key, competitor in (("elasticdl_bf16", "elasticdl_ps_bf16"), ("elasticdl_tcp", "elasticdl_ps_tcp")):
                variant = [r["mb_per_s"] for r in runs.get(key, [])]
                if variant:
                    rows.append({
                        "case": "ps_data_plane", "model": f"{size} float32", "competitor": competitor,
                        "metric": "MB/s", "median": median(variant), "runs": variant,
                        "ratio": median(paired_ratios(variant, edl)), "ratio_to": "elasticdl_ps",
                        "pull_mb_per_s": median([r["pull_mb_per_s"] for r in runs[key]]),
                        "push_mb_per_s": median([r["push_mb_per_s"] for r in runs[key]]),
                    })
            targets.append(_target(f"ps_data_plane {size}: elasticdl_ps / raw_grpc_echo", ratio, TARGETS["vs_raw_grpc"]))
            targets.append(_target(f"ps_data_plane {size}: elasticdl_ps", median(edl), TARGETS["data_plane_mb_per_s"],
                                   unit="MB/s"))
        if not dataplane["runs"]:
            rows.append(_status_row("ps_data_plane", "-", "error: see errors"))
    embedding = results.get("embedding")
    if embedding is not None:
        for size, runs in embedding["runs"].items():
            grpc = [r["held"] for r in runs["grpc"]]
            core = [r["held"] for r in runs["core"]]
            common = {"case": "embedding", "model": f"{size} ids", "metric": "ids/s per PS"}
            grpc_ratio = median(paired_ratios(grpc, core))
            rows.append({**common, "competitor": "elasticdl_ps", "median": median(grpc), "runs": grpc,
                         "create_ids_per_s": median([r["create"] for r in runs["grpc"]]),
                         "ratio": grpc_ratio, "ratio_to": "ps_core"})
            core_create = median([r["create"] for r in runs["core"]])
            rows.append({**common, "competitor": "ps_core", "median": median(core), "runs": core,
                         "create_ids_per_s": core_create, "ratio": None, "ratio_to": "",
                         # per second of the core's own CPU: its speed on a machine others load too
                         "held_per_cpu_s": median([r.get("held_per_cpu_s") for r in runs["core"]]),
                         "create_per_cpu_s": median([r.get("create_per_cpu_s") for r in runs["core"]])})
            targets.append(_target(f"embedding {size}: ps_core held ids", median(core),
                                   TARGETS["embedding_held_ids_per_s"], unit="ids/s"))
            targets.append(_target(f"embedding {size}: ps_core new ids", core_create,
                                   TARGETS["embedding_new_ids_per_s"], unit="ids/s"))
            targets.append(_target(f"embedding {size}: elasticdl_ps / ps_core", grpc_ratio,
                                   TARGETS["embedding_grpc_vs_core"]))
        for size, runs in embedding.get("memory", {}).items():
            rss = [r["rss_bytes_per_row"] for r in runs]
            physical = runs[0]["physical_bytes_per_row"]
            ratio = median(rss) / physical
            rows.append({"case": "embedding", "model": f"{size} rows", "competitor": "ps_table",
                         "metric": "resident bytes per row", "median": median(rss), "runs": rss,
                         "ratio": ratio, "ratio_to": f"physical ({physical:.0f} B)"})
            targets.append(_target(f"embedding {size}: bytes per row / physical", ratio,
                                   TARGETS["embedding_bytes_vs_physical"], at_most=True))
        if not embedding["runs"]:
            rows.append(_status_row("embedding", "-", "error: see errors"))
    recovery = results.get("elastic_recovery")
    if recovery is not None:
        for key, model, competitor, metric in (
            ("kill_worker_s", "digits, 2 workers", "kill_worker", "s to requeued task on another worker"),
            ("scale_up_s", "digits, 1 -> 2 workers", "scale_up", "s to new worker's first gradient"),
            ("kill_ps_s", "digits, 1 worker, 2 PS, sync", "kill_ps", "s from a PS SIGKILL to training again"),
            ("kill_ps_replicas_s", "digits, 1 worker, 2 PS, sync, --ps_replicas 1", "kill_ps_replicas",
             "s from a PS SIGKILL to training again"),
        ):
            measured = [r for r in recovery["runs"] if r]
            if measured and all(key not in r for r in measured):
                continue  # not measured in this run (a result file from before the row existed)
            values = [r.get(key) if r else None for r in recovery["runs"]]  # a failed repetition: None
            if any(v is not None for v in values):
                rows.append({"case": "elastic_recovery", "model": model, "competitor": competitor, "metric": metric,
                             "median": median(values), "runs": values, "ratio": None, "ratio_to": ""})
                if key == "scale_up_s":
                    targets.append(_target("elastic_recovery: new worker's first gradient", median(values),
                                           TARGETS["scale_up_s"], unit="s"))
                if key == "kill_ps_replicas_s":
                    targets.append(_target("elastic_recovery: --ps_replicas 1, PS SIGKILL to training again",
                                           median(values), TARGETS["replica_failover_s"], unit="s"))
            else:
                rows.append(_status_row("elastic_recovery", model, f"{competitor} error: see errors"))
    parquet = results.get("parquet_s3")
    if parquet is not None:
        if parquet["runs"]:
            model = f"ctr {parquet['rows']:,} rows"
            reader = [r["elasticdl_reader"] for r in parquet["runs"]]
            direct = [r["pyarrow_direct"] for r in parquet["runs"]]
            ratio = median(paired_ratios(reader, direct))
            rows.append({"case": "parquet_s3", "model": model, "competitor": "elasticdl_reader", "metric": "rows/s",
                         "median": median(reader), "runs": reader, "ratio": ratio, "ratio_to": "pyarrow_direct"})
            rows.append({"case": "parquet_s3", "model": model, "competitor": "pyarrow_direct", "metric": "rows/s",
                         "median": median(direct), "runs": direct, "ratio": None, "ratio_to": ""})
            if all("pyarrow_s3fs" in r for r in parquet["runs"]):
                s3fs_runs = [r["pyarrow_s3fs"] for r in parquet["runs"]]
                rows.append({"case": "parquet_s3", "model": model, "competitor": "pyarrow_s3fs", "metric": "rows/s",
                             "median": median(s3fs_runs), "runs": s3fs_runs,
                             "ratio": median(paired_ratios(s3fs_runs, direct)), "ratio_to": "pyarrow_direct"})
            targets.append(_target("parquet_s3: elasticdl_reader / pyarrow_direct", ratio, TARGETS["vs_pyarrow"]))
        else:
            rows.append(_status_row("parquet_s3", "-", "error: see errors"))
    if results.get("stream") is not None:
        from benchmarks.stream import add_rows

        add_rows(results["stream"], rows, targets)
    if results.get("replicas") is not None:
        from benchmarks.replicas import replica_rows

        more = replica_rows(results["replicas"], TARGETS["replicas_vs_none"])
        rows, targets = rows + more[0], targets + more[1]
    if results.get("endless_ids") is not None:
        from benchmarks.endless_ids import endless_rows

        more = endless_rows(results["endless_ids"], TARGETS["endless_rss_growth"], TARGETS["endless_auc_gap"])
        rows, targets = rows + more[0], targets + more[1]
    return rows, targets


def _status_row(case: str, model: str, why: str) -> dict:
    return {"case": case, "model": model, "competitor": "-", "metric": "-", "median": None, "runs": [],
            "ratio": None, "ratio_to": "", "status": why}


def _target(name: str, ratio: float | None, threshold: float, unit: str = "x", at_most: bool = False) -> dict:
    """A target met or missed: ratios and rates (``x``, ``MB/s``) must reach the threshold,
    seconds (``s``), percentages of waste (``%``) and ``at_most`` figures must stay at or under
    it. ``ratio`` holds the measured value."""
    at_most = at_most or unit in ("s", "%")
    if ratio is None:
        status = "n/a"
    else:
        status = "PASS" if (ratio <= threshold if at_most else ratio >= threshold) else "MISS"
    return {"target": name, "ratio": ratio, "threshold": threshold, "unit": unit, "at_most": at_most,
            "result": status}


def _rejected_stale(model: str, comps: dict, rows: list[dict]) -> list[dict]:
    """Rows of the sync 2-worker jobs' pushes refused as stale (% of pushes, median over the
    repetitions); the default's is held to TARGETS["rejected_stale_pct"]."""
    targets = []
    for comp in ("elasticdl_2w1ps_sync", "elasticdl_2w1ps_sync_gtw1"):
        runs = comps.get(comp)
        if not runs:
            continue
        pct = [100.0 * r["staleness"]["rejected_stale_rate"] if r and r.get("staleness") else None for r in runs]
        rows.append({"case": "training", "model": model, "competitor": comp, "metric": "% pushes rejected as stale",
                     "median": median(pct), "runs": pct, "ratio": None, "ratio_to": ""})
        if comp == "elasticdl_2w1ps_sync" and model.startswith(REJECTED_STALE_MODELS):
            targets.append(_target(f"training {model}: {comp} rejected as stale", median(pct),
                                   TARGETS["rejected_stale_pct"], unit="%"))
    return targets


def _with_unit(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "%":
        return f"{value:.1f}%"
    return f"{_fmt(value)} {unit}"


def render_table(rows: list[dict], targets: list[dict]) -> str:
    head = ["case", "model", "competitor", "metric", "median", "runs", "first gradient s", "ratio", "vs model.fit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r.get("status"):
            cells = [r["case"], r["model"], r["status"], "", "", "", "", "", ""]
        else:
            ratio = f"{r['ratio']:.2f}x {r['ratio_to']}" if r.get("ratio") is not None else ""
            if r.get("ratio_vs_stream") is not None:
                ratio += f"; {r['ratio_vs_stream']:.2f}x raw_grpc_stream_1MB"
            if r.get("ratio_vs_tcp") is not None:
                ratio += f"; {r['ratio_vs_tcp']:.2f}x raw_tcp_socket"
            vs_fit = f"{r['ratio_vs_fit']:.2f}x" if r.get("ratio_vs_fit") is not None else ""
            extra = ""
            if r.get("pull_mb_per_s") is not None:
                extra = f" (pull {_fmt(r['pull_mb_per_s'])}, push {_fmt(r['push_mb_per_s'])})"
            if r.get("create_ids_per_s") is not None:
                extra = f" (create {_fmt(r['create_ids_per_s'])})"
            if r.get("held_per_cpu_s") is not None:
                extra = (f" (create {_fmt(r['create_ids_per_s'])}; per CPU second: held "
                         f"{_fmt(r['held_per_cpu_s'])}, create {_fmt(r['create_per_cpu_s'])})")
            digits = 2 if r["case"] == "elastic_recovery" else 1  # seconds: two decimals
            cells = [r["case"], r["model"], r["competitor"], r["metric"], _fmt(r["median"], digits) + extra,
                     " ".join(_fmt(v, digits) for v in r["runs"]), _fmt(r.get("ttfg_s")), ratio, vs_fit]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | measured | threshold | result |", "|---|---|---|---|"]
    for t in targets:
        unit = t.get("unit", "x")
        measured = "-" if t["ratio"] is None else _with_unit(t["ratio"], unit)
        bound = "<=" if t.get("at_most", unit in ("s", "%")) else ">="
        lines.append(f"| {t['target']} | {measured} | {bound} {_with_unit(t['threshold'], unit)} | {t['result']} |")
    return "\n".join(lines)


# Rows that are not ElasticDL: the competitors, the physical limit, the PS code without gRPC.
BASELINES = ("keras_fit", "pss_", "raw_grpc", "ps_core", "pyarrow")


def write_chart(rows: list[dict], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    groups = {}
    for r in rows:
        if r.get("median") is not None:
            groups.setdefault((r["case"], r["model"], r["metric"]), []).append(r)
    columns = min(3, max(1, len(groups)))
    rows_of_plots = max(1, math.ceil(len(groups) / columns))
    fig, axes = plt.subplots(rows_of_plots, columns, figsize=(5 * columns, 4.2 * rows_of_plots), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, ((case, model, metric), rs) in zip(axes.flat, groups.items()):
        # ElasticDL in blue, what it is measured against in grey; dots are the repetitions.
        colors = ["tab:gray" if r["competitor"].startswith(BASELINES) else "tab:blue" for r in rs]
        ax.bar(range(len(rs)), [r["median"] for r in rs], color=colors)
        for i, r in enumerate(rs):
            ax.plot([i] * len(r["runs"]), [v for v in r["runs"]], "k.", markersize=4)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([r["competitor"] for r in rs], rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{case}: {model}", fontsize=9)
        ax.set_ylabel(metric)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"chart: {path}"


# ---------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition (smoke test only)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default 3; --quick: 1)")
    parser.add_argument("--models", default="", help="training models (default: digits,dense5m,deepfm_1m_ids,collab_50k_users)")
    parser.add_argument("--competitors", default="", help="training competitors (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="cores per competitor (default: all)")
    parser.add_argument("--out", default=os.path.join("runs", "benchmarks"), help="results, logs and data")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    args = parser.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES) - set(OPT_IN_CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(CASES + OPT_IN_CASES)}")
    args.reps = args.reps or (1 if args.quick else 3)
    return args


def run_case(case: str, args, out_dir: str) -> dict:
    try:
        if case == "training":
            return run_training(args, out_dir)
        if case == "ps_data_plane":
            return run_dataplane(args, out_dir)
        if case == "embedding":
            return run_embedding(args, out_dir)
        if case == "parquet_s3":
            return run_parquet_s3(args, out_dir)
        if case == "stream":
            from benchmarks.stream import run_case as run_stream

            return run_stream(args, out_dir)
        if case == "replicas":
            from benchmarks.replicas import run_replicas

            return run_replicas(args, out_dir)
        if case == "endless_ids":
            from benchmarks.endless_ids import run_endless_ids

            return run_endless_ids(args, out_dir)
        return run_recovery(args, out_dir)
    except Exception as err:  # one broken case must not hide the others
        log(f"{case} failed: {traceback.format_exc()}")
        return {"runs": {}, "errors": [f"{type(err).__name__}: {err}"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = os.path.abspath(args.out)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    from elasticdl.rpc.auth import ensure_process_token

    ensure_process_token(out_dir)  # every gRPC server needs a job token: the suite is one "job"
    started = time.time()
    # One case at a time: the quick suite is CPU-bound on 2 cores, running cases side by
    # side saves nothing.
    results = {case: run_case(case, args, out_dir) for case in args.cases.split(",")}
    rows, targets = build_rows(results)
    table = render_table(rows, targets)
    doc = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
        "quick": args.quick, "reps": args.reps, "machine": machine_info(), "platform": platform.platform(),
        "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": rows, "targets": targets, "results": results, "table": table,
    }
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table + "\n")
    chart = write_chart(rows, os.path.join(out_dir, "results.png"))
    print(table)
    errors = [e for r in results.values() for e in r.get("errors", [])]
    for e in errors:
        print(f"\nERROR: {e}")
    print(f"\n{chart}\nresults: {json_path} ({doc['seconds']:.0f} s, {args.reps} repetition(s)"
          f"{', quick: sizes are tiny, figures mean nothing' if args.quick else ''})")
    return 1 if errors else 0
