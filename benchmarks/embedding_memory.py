"""Embedding tables on the PS: a worker's memory against the vocabulary, and PS row throughput.

    python -m benchmarks.embedding_memory            # both measurements, prints a table + JSON
    python -m benchmarks.embedding_memory --quick    # tiny sizes (a smoke test)
    python -m benchmarks.embedding_memory --spec '{"vocabularies": [100000, 1000000], ...}'  # both, as a child
    python -m benchmarks.embedding_memory --spec '{"tables": [["100k", 100000]], ...}'  # the suite's case

**Worker memory.** For each vocabulary (default 100,000 and 1,000,000 ids) two real PS
processes (``python -m elasticdl.ps.main``: async, Adam) serve a worker process that
trains a model with one 16-wide ``elasticdl.layers.Embedding`` (``input_dim`` = the
vocabulary) over 8 id fields, for the same number of batches of 1,024 records whose ids
are drawn uniformly from the vocabulary, through the real worker code
(``Worker.train_batch``: lookups, row gradients, pushes). The worker's resident memory
(VmRSS, and its peak VmHWM) is read from /proc at the end; so is the PS's, which does
grow with the rows created. The reference row shows a plain ``keras.layers.Embedding``
of the 1,000,000-id vocabulary held in a worker (the swap turned off), as before this
feature: the table, its gradient and the pushed copy live in the worker.

**Row throughput per PS.** One PS process (async, Adam, rows of 16 floats) and one
client in this process: each round looks up a batch of unique ids (get-or-create) and
pushes one gradient row per id, as a worker does for one table. Figures are ids per
second per PS (one id = one lookup + one update): for new ids (rows created) and for ids
already held, over gRPC, and the PS core alone in this process (no gRPC).

**Row throughput per table size** (the suite's ``embedding`` case, ``--spec`` with
``tables``). For each table size (100,000 and 1,000,000 ids), every repetition starts a
fresh PS process (async, Adam, rows of 16 floats) and, from one client in this process:
``create`` looks up every id of the table once, in a shuffled order and in batches,
pushing one gradient row per id (so the PS creates each row and updates it); ``held``
then looks up and updates batches of unique ids drawn uniformly from the full table for a
few seconds. The same two phases run on the PS core in this process (no gRPC): the
ceiling of the PS's own code. Figures are ids per second per PS.

**Bytes per row** (the suite's ``embedding`` case, ``memory_tables``). A fresh process with a
PS's environment (its malloc settings) makes a PS core, creates every row of a table (Adam,
rows of 16 floats) as the create phase does, and reads its resident memory (VmRSS) before and
after: the growth over the rows is the bytes a row costs, against its physical size, 16 x 4 x
(1 + 2 slots) + 8 (the id) = 200 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import child_env, emit

FIELDS = 8
DIM = 16
ADAM = {"name": "Adam", "config": {"learning_rate": 0.001}}
DEFAULT_SPEC = {
    "vocabularies": [100_000, 1_000_000],
    "steps": 150,
    "batch": 1024,
    "dense_reference": True,
    "throughput_batches": [1024, 8192],
    "throughput_seconds": 3.0,
    "workdir": os.path.join("runs", "benchmarks", "embedding"),
}
QUICK_SPEC = {**DEFAULT_SPEC, "vocabularies": [10_000, 100_000], "steps": 20, "batch": 256,
              "dense_reference": False, "throughput_batches": [1024], "throughput_seconds": 0.5}


def _memory_kb(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _wait_file(path: str, timeout: float = 120.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            return int(open(path).read())
        time.sleep(0.05)
    raise TimeoutError(f"no {path} after {timeout:.0f}s")


def _start_ps(backend, workdir: str, tag: str, num_ps: int) -> list[str]:
    from elasticdl.config import JobConfig

    config = os.path.join(workdir, f"{tag}-job_config.json")
    with open(config, "w") as f:
        f.write(JobConfig.from_flags(job_name=f"bench-{tag}", num_ps=num_ps, use_async=True, log_level="WARNING").to_json())
    optimizer = os.path.join(workdir, f"{tag}-optimizer.json")
    with open(optimizer, "w") as f:
        json.dump(ADAM, f)
    addresses = []
    for ps_id in range(num_ps):
        ready = os.path.join(workdir, f"{tag}-ps-{ps_id}.port")
        if os.path.exists(ready):
            os.remove(ready)
        backend.start("ps", ps_id, ["--job_config", config, "--optimizer_spec", optimizer,
                                    "--ps_id", str(ps_id), "--ready_file", ready])
        addresses.append(f"127.0.0.1:{_wait_file(ready)}")
    return addresses


# ---------------------------------------------------------------- the worker process


def _spec_for(vocabulary: int, keras_table: bool):
    """A ModelSpec built in code: ids [batch, 8] -> one table -> a logistic head."""
    import keras
    import tensorflow as tf

    from elasticdl.layers import Embedding
    from elasticdl.model.spec import ModelSpec

    def custom_model():
        ids = keras.Input(shape=(FIELDS,), dtype="int64", name="ids")
        if keras_table:
            rows = keras.layers.Embedding(vocabulary, DIM, name="items")(ids)
        else:
            rows = Embedding(DIM, input_dim=vocabulary, name="items")(ids)
        return keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(rows)))

    def loss(labels, logits):
        return tf.reduce_mean(keras.losses.binary_crossentropy(labels, logits, from_logits=True))

    return ModelSpec(__file__, "custom_model", custom_model, loss, lambda: keras.optimizers.Adam(0.001),
                     lambda dataset, mode, metadata: dataset)


def worker_main(spec: dict) -> dict:
    """Train ``steps`` batches against the PS at ``spec['ps']``; report this process's memory."""
    from elasticdl.model.tf_runtime import configure_tensorflow

    configure_tensorflow(1)
    import tensorflow as tf

    from elasticdl.model.trainer import Trainer
    from elasticdl.rpc.ps_client import PSClient
    from elasticdl.worker.consistency import ConsistencyPolicy
    from elasticdl.worker.worker import Worker

    keras_table = spec.get("keras_table", False)
    model_spec = _spec_for(spec["vocabulary"], keras_table)
    threshold = -1.0 if keras_table else 2.0
    trainer = Trainer(model_spec, {}, embedding_swap_threshold_mb=threshold)
    ps = PSClient(spec["ps"])
    worker = Worker(0, model_spec, trainer, master=None, ps=ps, minibatch_size=spec["batch"],
                    consistency=ConsistencyPolicy(use_async=True, num_ps=ps.num_ps))
    rng = np.random.default_rng(0)
    touched = np.zeros(spec["vocabulary"], bool)
    started = time.perf_counter()
    after_first = None
    for step in range(spec["steps"]):
        ids = rng.integers(0, spec["vocabulary"], (spec["batch"], FIELDS), dtype=np.int64)
        touched[ids.ravel()] = True
        labels = rng.integers(0, 2, (spec["batch"], 1)).astype(np.float32)
        worker.train_batch(tf.constant(ids), tf.constant(labels))
        if step == 0:
            after_first = _memory_kb()
    seconds = time.perf_counter() - started
    memory = _memory_kb()
    ps.close()
    return {
        "vocabulary": spec["vocabulary"], "keras_table": keras_table, "steps": spec["steps"],
        "rss_mb": memory["VmRSS"] / 1024, "peak_rss_mb": memory["VmHWM"] / 1024,
        "rss_after_first_batch_mb": after_first["VmRSS"] / 1024,
        "ids_touched": int(touched.sum()), "batches_per_s": spec["steps"] / seconds,
    }


def _run_worker(spec: dict, workdir: str, timeout: float = 1800) -> dict:
    log = os.path.join(workdir, f"worker-{spec['vocabulary']}-{int(spec.get('keras_table', False))}.log")
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.embedding_memory", "--worker", json.dumps(spec)],
            env=child_env(), stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("WORKER_RESULT "):
            return json.loads(line[len("WORKER_RESULT "):])
    raise RuntimeError(f"the benchmark worker failed (exit {proc.returncode}); see {log}")


def measure_memory(spec: dict, workdir: str) -> list[dict]:
    from elasticdl.launch.local import LocalBackend

    cases = [(v, False) for v in spec["vocabularies"]]
    if spec.get("dense_reference"):
        cases.append((max(spec["vocabularies"]), True))
    results = []
    for vocabulary, keras_table in cases:
        tag = f"mem-{vocabulary}-{int(keras_table)}"
        backend = LocalBackend(os.path.join(workdir, "logs", tag))
        try:
            addresses = _start_ps(backend, workdir, tag, num_ps=2)
            steps = spec["steps"] if not keras_table else max(3, spec["steps"] // 30)
            result = _run_worker({"vocabulary": vocabulary, "keras_table": keras_table, "ps": addresses,
                                  "steps": steps, "batch": spec["batch"]}, workdir)
            ps_memory = [_memory_kb(backend.pid("ps", i)) for i in range(2)]
            result["ps_rss_mb"] = sum(m["VmRSS"] for m in ps_memory) / 1024
        finally:
            backend.stop_all()
        results.append(result)
    return results


# ---------------------------------------------------------------- PS row throughput


def _throughput(lookup, push, batch: int, seconds: float, new_ids: bool, rng, held: int = 200_000,
                cpu: dict | None = None) -> float:
    """ids per second: each round one lookup (get-or-create) and one update of ``batch`` ids.

    ``new_ids``: ids no table holds yet (from 10M up); otherwise unique ids drawn from the
    ``held`` ids 0 .. held-1, which the caller created beforehand (32 batches drawn before the
    clock starts, then taken in turn: drawing them is the client's work, not the PS's).
    ``cpu``: gets ``"ids_per_cpu_s"``, the rate per second of this process's CPU time.
    """
    pool = [np.unique(rng.integers(0, held, batch, dtype=np.int64)) for _ in range(0 if new_ids else 32)]
    grads = np.full((batch, DIM), 1e-3, np.float32)
    done, rounds, started, cpu_started = 0, 0, time.perf_counter(), time.process_time()
    next_new = 10_000_000
    while time.perf_counter() - started < seconds or done == 0:
        if new_ids:
            ids = np.arange(next_new, next_new + batch, dtype=np.int64)
            next_new += batch
        else:
            ids = pool[rounds % len(pool)]
        lookup(ids)
        push(ids, grads[: ids.size])
        done += ids.size
        rounds += 1
    if cpu is not None:
        cpu["ids_per_cpu_s"] = done / max(time.process_time() - cpu_started, 1e-9)
    return done / (time.perf_counter() - started)


def measure_throughput(spec: dict, workdir: str) -> dict:
    from elasticdl.launch.local import LocalBackend
    from elasticdl.model.embedding.table import IndexedRows, TableInfo
    from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
    from elasticdl.ps.server import ParameterServer, PSSettings
    from elasticdl.rpc.ps_client import PSClient

    info = TableInfo("bench/embeddings", DIM, {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 1})
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    backend = LocalBackend(os.path.join(workdir, "logs", "throughput"))
    try:
        client = PSClient(_start_ps(backend, workdir, "throughput", num_ps=1))
        client.push_model({"bench/bias": np.zeros(1, np.float32)})
        client.push_embedding_table_infos([info])
        client.lookup(info.name, np.arange(200_000, dtype=np.int64), create=True)  # the hot ids exist

        def grpc_push(ids, grads):
            answer = client.push_gradients({0: {info.name: IndexedRows(ids, grads)}}, [0], None, 0)[0]
            assert answer.accepted, answer.reason

        for batch in spec["throughput_batches"]:
            out[f"grpc_new_ids_{batch}"] = _throughput(
                lambda ids: client.lookup(info.name, ids, True), grpc_push, batch, spec["throughput_seconds"], True, rng)
            out[f"grpc_held_ids_{batch}"] = _throughput(
                lambda ids: client.lookup(info.name, ids, True), grpc_push, batch, spec["throughput_seconds"], False, rng)
        client.close()
    finally:
        backend.stop_all()

    core = ParameterServer(PSSettings(use_async=True), make_optimizer(OptimizerSpec.from_json_dict(ADAM)))
    core.push_model({})
    core.push_embedding_table_infos([info])
    core.lookup_embeddings(info.name, np.arange(200_000, dtype=np.int64), True)
    for batch in spec["throughput_batches"]:
        def core_push(ids, grads):
            core.push_gradients({info.name: IndexedRows(ids, grads)}, core.shard.version, None)

        out[f"core_held_ids_{batch}"] = _throughput(
            lambda ids: core.lookup_embeddings(info.name, ids, True), core_push, batch, spec["throughput_seconds"], False, rng)
    return out


# ---------------------------------------------------------------- per table size (the suite)


def _create_all(lookup, push, vocabulary: int, batch: int, rng, cpu: dict | None = None) -> float:
    """ids per second creating (and updating once) every row of a table of ``vocabulary`` ids
    (``cpu``: as for _throughput)."""
    # Shuffled, as a worker meets ids: the PS must not see conveniently sorted batches.
    order = rng.permutation(vocabulary).astype(np.int64)
    grads = np.full((batch, DIM), 1e-3, np.float32)
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, vocabulary, batch):
        ids = order[start:start + batch]
        lookup(ids)
        push(ids, grads[: ids.size])
    if cpu is not None:
        cpu["ids_per_cpu_s"] = vocabulary / max(time.process_time() - cpu_started, 1e-9)
    return vocabulary / (time.perf_counter() - started)


def _table_rates_grpc(backend, workdir: str, tag: str, vocabulary: int, spec: dict, rng) -> dict[str, float]:
    """create / held ids per second through a fresh PS process holding one table."""
    from elasticdl.model.embedding.table import IndexedRows, TableInfo
    from elasticdl.rpc.ps_client import PSClient

    info = TableInfo("bench/embeddings", DIM, {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 1})
    client = PSClient(_start_ps(backend, workdir, tag, num_ps=1))
    try:
        client.push_model({"bench/bias": np.zeros(1, np.float32)})
        client.push_embedding_table_infos([info])

        def lookup(ids):
            return client.lookup(info.name, ids, True)

        def push(ids, grads):
            answer = client.push_gradients({0: {info.name: IndexedRows(ids, grads)}}, [0], None, 0)[0]
            assert answer.accepted, answer.reason

        create = _create_all(lookup, push, vocabulary, spec["batch"], rng)
        held = _throughput(lookup, push, spec["batch"], spec["seconds"], False, rng, held=vocabulary)
        return {"create": create, "held": held}
    finally:
        client.close()


def _table_rates_core(vocabulary: int, spec: dict, rng) -> dict[str, float]:
    """The same two phases on a PS core in this process: no gRPC, no encoding."""
    from elasticdl.model.embedding.table import IndexedRows, TableInfo
    from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
    from elasticdl.ps.server import ParameterServer, PSSettings

    info = TableInfo("bench/embeddings", DIM, {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 1})
    core = ParameterServer(PSSettings(use_async=True), make_optimizer(OptimizerSpec.from_json_dict(ADAM)))
    core.push_model({})
    core.push_embedding_table_infos([info])

    def lookup(ids):
        return core.lookup_embeddings(info.name, ids, True)

    def push(ids, grads):
        core.push_gradients({info.name: IndexedRows(ids, grads)}, core.shard.version, None)

    create_cpu: dict[str, float] = {}
    held_cpu: dict[str, float] = {}
    create = _create_all(lookup, push, vocabulary, spec["batch"], rng, create_cpu)
    held = _throughput(lookup, push, spec["batch"], spec["seconds"], False, rng, held=vocabulary, cpu=held_cpu)
    # Per second of this process's CPU: the core's own speed, whatever else the machine runs.
    return {"create": create, "held": held, "create_per_cpu_s": create_cpu["ids_per_cpu_s"],
            "held_per_cpu_s": held_cpu["ids_per_cpu_s"]}


def rss_per_row(spec: dict) -> dict[str, float]:
    """In this (fresh) process: the resident bytes each row of a ``spec["rows"]``-row table costs."""
    import gc

    from elasticdl.model.embedding.table import IndexedRows, TableInfo
    from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
    from elasticdl.ps.server import ParameterServer, PSSettings

    info = TableInfo("bench/embeddings", DIM, {"distribution": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 1})
    optimizer = make_optimizer(OptimizerSpec.from_json_dict(ADAM))
    core = ParameterServer(PSSettings(use_async=True), optimizer)
    core.push_model({})
    core.push_embedding_table_infos([info])
    rows, batch = spec["rows"], spec["batch"]
    order = np.random.default_rng(0).permutation(rows + batch).astype(np.int64)

    def create(ids):
        grads = np.full_like(core.lookup_embeddings(info.name, ids, True), 1e-3)
        core.push_gradients({info.name: IndexedRows(ids, grads)}, core.shard.version, None)

    # One batch first: the allocator's pool for a batch's temporaries is not counted as rows.
    create(order[rows:])
    gc.collect()
    before = _memory_kb()["VmRSS"]
    for start in range(0, rows, batch):
        create(order[start:start + batch])
    gc.collect()
    after = _memory_kb()["VmRSS"]
    table = core.shard.embeddings[info.name]
    return {"rss_bytes_per_row": (after - before) * 1024 / rows, "nbytes_per_row": table.nbytes / len(table),
            "rss_mb": after / 1024,
            "physical_bytes_per_row": DIM * 4 * (1 + len(optimizer.slot_names)) + 8}


def _rss_child(rows: int, batch: int, workdir: str) -> dict[str, float]:
    log = os.path.join(workdir, "logs", f"rss-{rows}.log")
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.embedding_memory", "--rss", json.dumps({"rows": rows, "batch": batch})],
            env=child_env(), stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800, stdin=subprocess.DEVNULL,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("RSS_RESULT "):
            return json.loads(line[len("RSS_RESULT "):])
    raise RuntimeError(f"the bytes-per-row child failed (exit {proc.returncode}); see {log}")


def run_tables(spec: dict) -> dict:
    """{label: {"grpc": [{"create", "held"} per repetition], "core": [...]}} for each table size.

    ``spec``: ``tables`` ([label, ids] pairs), ``batch`` (ids per round), ``seconds`` (of
    the held phase), ``reps``, ``workdir``, ``memory_tables`` ([label, rows] pairs: bytes per
    row, under "memory"). A fresh PS process per table and repetition.
    """
    from elasticdl.launch.local import LocalBackend

    workdir = os.path.abspath(spec["workdir"])
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    os.environ.update(child_env())
    out: dict[str, dict[str, list[dict[str, float]]]] = {label: {"grpc": [], "core": []} for label, _ in spec["tables"]}
    memory: dict[str, list[dict[str, float]]] = {}
    for rep in range(spec["reps"]):
        rng = np.random.default_rng(rep)
        for label, vocabulary in spec["tables"]:
            tag = f"table-{label}-r{rep}"
            backend = LocalBackend(os.path.join(workdir, "logs", tag))
            try:
                out[label]["grpc"].append(_table_rates_grpc(backend, workdir, tag, vocabulary, spec, rng))
            finally:
                backend.stop_all()
            out[label]["core"].append(_table_rates_core(vocabulary, spec, rng))
            sys.stderr.write(f"rep {rep + 1} {label}: {out[label]['grpc'][-1]} (core {out[label]['core'][-1]})\n")
        for label, rows in spec.get("memory_tables", []):
            memory.setdefault(label, []).append(_rss_child(rows, spec["batch"], workdir))
            sys.stderr.write(f"rep {rep + 1} {label} bytes per row: {memory[label][-1]}\n")
    return {"tables": out, "memory": memory, "spec": spec}


# ---------------------------------------------------------------- entry points


def run(spec: dict) -> dict:
    spec = {**DEFAULT_SPEC, **spec}
    workdir = os.path.abspath(spec["workdir"])
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    os.environ.update(child_env())
    return {"memory": measure_memory(spec, workdir), "ids_per_s_per_ps": measure_throughput(spec, workdir),
            "spec": spec}


def render(result: dict) -> str:
    lines = ["| worker | vocabulary | ids touched | worker RSS MB | worker peak RSS MB | PS RSS MB (2 PS) | batches/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["memory"]:
        kind = "keras.layers.Embedding in the worker (no swap)" if r["keras_table"] else "elasticdl.layers.Embedding"
        lines.append(f"| {kind} | {r['vocabulary']:,} | {r['ids_touched']:,} | {r['rss_mb']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['ps_rss_mb']:.0f} | {r['batches_per_s']:.1f} |")
    lines += ["", "| PS row throughput (lookup + update) | ids/s per PS |", "|---|---:|"]
    for key, value in result["ids_per_s_per_ps"].items():
        lines.append(f"| {key.replace('_', ' ')} | {value:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    from elasticdl.launch.child import die_with_parent

    die_with_parent()  # no orphans if the benchmark is killed (a no-op when run by hand)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", help="JSON: run as a child of the benchmark suite (prints BENCH_RESULT)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rss", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, figures mean nothing")
    args = parser.parse_args()
    if args.rss:
        print("RSS_RESULT " + json.dumps(rss_per_row(json.loads(args.rss))), flush=True)
        return
    if args.worker:
        print("WORKER_RESULT " + json.dumps(worker_main(json.loads(args.worker))), flush=True)
        return
    if args.spec:
        spec = json.loads(args.spec)
        emit(run_tables(spec) if "tables" in spec else run(spec))
        return
    result = run(QUICK_SPEC if args.quick else DEFAULT_SPEC)
    print(render(result))
    path = os.path.join(os.path.abspath(result["spec"]["workdir"]), "results.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
