"""One training run of one competitor on one or more models (a child process of the runner).

    python -m benchmarks.training --spec '{"competitor": "elasticdl", "num_workers": 2, ...}'

Competitors: ``keras_fit`` (model.fit in this process), ``elasticdl`` (a real local job:
this process is the master, PS and workers are child processes) and ``pss``
(tf.distribute.ParameterServerStrategy + ClusterCoordinator; this process is the
coordinator, workers and PS are tf.distribute.Server child processes).

Every competitor reads the same TFRecord files through the model zoo's ``dataset_fn``,
builds the model with the model zoo's ``custom_model``, and trains with its ``loss`` and
``optimizer`` at the same minibatch size. Two figures come out per model:

- ``examples_per_s``: steady state. The first ``warmup_batches`` minibatches of every
  worker (one ElasticDL task: 8 minibatches) are start-up; the rate is the records
  finished after the last worker's warm-up divided by the time from then to the end.
- ``ttfg_s``: time to the first applied gradient, from the moment the competitor starts
  (TensorFlow already imported in this process) to the first optimizer update.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

from benchmarks.common import child_env, emit, free_port


def _configure_tf(intra: int, inter: int):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    return tf


def _load(model: dict):
    from elasticdl.config import parse_kv_params
    from elasticdl.model.spec import load_model_spec

    spec = load_model_spec(model["model_zoo"], model["model_def"])
    return spec, parse_kv_params(model["model_params"], "model_params")


def _dataset(tf, spec, files: list[str]):
    from elasticdl.mode import Mode
    from elasticdl.model.spec import DatasetMetadata

    return spec.dataset_fn(tf.data.TFRecordDataset(files), Mode.TRAINING, DatasetMetadata("tfrecord"))


def _log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _steady(times: list[float], sizes: list[int], warmup: int) -> tuple[float, float, int]:
    """(examples/s, window seconds, window records) after ``warmup`` minibatches."""
    warmup = min(warmup, len(times) - 1)
    window = times[-1] - times[warmup - 1] if warmup > 0 else times[-1] - times[0]
    records = sum(sizes[warmup:])
    return (records / window if window > 0 else 0.0), window, records


# ---------------------------------------------------------------- model.fit


def run_keras_fit(spec_json: dict) -> dict:
    threads = spec_json["threads"]
    tf = _configure_tf(threads, min(2, threads))
    import keras

    out = {}
    for model_cfg in spec_json["models"]:
        t0 = time.time()
        spec, params = _load(model_cfg)
        model = spec.build_model(params)
        model.compile(optimizer=spec.optimizer(), loss=spec.loss, jit_compile=spec_json.get("jit_compile", "auto"))
        bs, n, epochs = model_cfg["batch_size"], model_cfg["records"], model_cfg["epochs"]
        dataset = _dataset(tf, spec, model_cfg["files"]).batch(bs)
        times: list[float] = []

        class Timer(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None, times=times):
                times.append(time.time())

        model.fit(dataset, epochs=epochs, verbose=0, callbacks=[Timer()])
        per_epoch = math.ceil(n / bs)
        sizes = [bs if i < per_epoch - 1 else n - (per_epoch - 1) * bs for i in range(per_epoch)] * epochs
        rate, window, records = _steady(times, sizes[: len(times)], spec_json["warmup_batches"])
        out[model_cfg["name"]] = {
            "examples_per_s": rate, "ttfg_s": times[0] - t0, "window_s": window,
            "window_records": records, "records": sum(sizes), "batches": len(times),
            "jit_compile": bool(model.jit_compile), "total_s": times[-1] - t0,
        }
    return out


# ---------------------------------------------------------------- ElasticDL


_REPORTS: list[tuple[float, int, int]] = []  # (time, worker, records) of accepted task reports


def _observe_task_reports() -> list[tuple[float, int, int]]:
    """Note the time of every accepted task report the master's servicer answers (once per process)."""
    from elasticdl.master import servicer as master_servicer

    cls = master_servicer.MasterServicer
    if not getattr(cls, "_bench_observed", False):
        original = cls.report_task_result

        def timed_report(self, request, context):
            reply = original(self, request, context)
            if reply.accepted and not request.err_message:
                _REPORTS.append((time.time(), request.worker_id, int(request.records)))
            return reply

        cls.report_task_result = timed_report
        cls._bench_observed = True
    return _REPORTS


def run_elasticdl(spec_json: dict) -> dict:
    """A real ``elasticdl train`` through the Python API (``elasticdl.api.run``).

    Two observers are attached without touching the job: the master's gRPC servicer
    notes the time of every accepted task report (worker id, records), and the backend,
    once it has handed out the PS addresses, watches the PS version (a tiny RPC every
    10 ms) until the first gradient has been applied.
    """
    from elasticdl.model.tf_runtime import quiet_tensorflow

    quiet_tensorflow()
    import tensorflow  # noqa: F401  (imported before the clock starts, as for the other competitors)

    from elasticdl import api
    from elasticdl.config import suggest_job_name
    from elasticdl.launch.local import LocalBackend
    from elasticdl.rpc.ps_client import PSClient

    reports = _observe_task_reports()

    class InstrumentedBackend(LocalBackend):
        first_update: float | None = None

        def ps_addresses(self, *args, **kwargs):
            addresses = super().ps_addresses(*args, **kwargs)
            threading.Thread(target=self._watch_first_update, args=(addresses,), daemon=True).start()
            return addresses

        def _watch_first_update(self, addresses):
            ps = PSClient(addresses)
            try:
                while self.first_update is None:
                    if hasattr(ps, "stats"):
                        updated = any(s.version > 0 for s in ps.stats())
                    else:  # pull(version=0) carries no parameters while the model is at 0
                        pulled = ps.pull([0] * ps.num_ps)
                        updated = all(p.initialized for p in pulled) and any(p.version > 0 for p in pulled)
                    if updated:
                        self.first_update = time.time()
                        return
                    time.sleep(0.01)
            except Exception:  # the job ended first
                pass
            finally:
                ps.close()

    out = {}
    nw = spec_json["num_workers"]
    for model_cfg in spec_json["models"]:
        reports.clear()
        config = api.make_config(
            model_zoo=model_cfg["model_zoo"], model_def=model_cfg["model_def"],
            model_params=model_cfg["model_params"], training_data=model_cfg["data_dir"],
            minibatch_size=model_cfg["batch_size"], num_epochs=model_cfg["epochs"],
            num_minibatches_per_task=spec_json["warmup_batches"],
            num_workers=nw, num_ps=spec_json.get("num_ps", 1),
            use_async=spec_json.get("use_async", False),
            **({"grads_to_wait": spec_json["grads_to_wait"]} if "grads_to_wait" in spec_json else {}),
            push_steps=spec_json.get("push_steps", 1),
            wire_dtype=spec_json.get("wire_dtype", "float32"),
            tensor_transport=spec_json.get("tensor_transport", "grpc"),
            overlap_communication=spec_json.get("overlap_communication", False),
            ps_replicas=spec_json.get("ps_replicas", 0),
            **({"slice_dense_above_mb": spec_json["slice_dense_above_mb"]} if "slice_dense_above_mb" in spec_json else {}),
            num_threads_per_process=max(1, spec_json["threads"] // nw),
            job_name=suggest_job_name(f"{spec_json['tag']}-{model_cfg['name']}"), log_level="WARNING",
            **model_cfg.get("job_flags", {}),
        )
        backend = InstrumentedBackend(config.job.effective_log_dir)
        t0 = time.time()
        report = api.run(config, "train", backend=backend)
        expected = model_cfg["records"] * model_cfg["epochs"]
        if report.records_trained != expected or getattr(report, "dropped_tasks", 0):
            raise RuntimeError(
                f"the job trained {report.records_trained} of {expected} records "
                f"({getattr(report, 'dropped_tasks', 0)} tasks dropped); see {os.path.abspath(report.log_dir)}"
            )
        events = sorted(reports)
        workers = {w for _, w, _ in events}
        warm = max(min(t for t, w, _ in events if w == worker) for worker in workers)
        after = [(t, r) for t, _, r in events if t > warm]
        if not after:  # a worker joined only at the end (tiny --quick jobs): from the first report
            warm = events[0][0]
            after = [(t, r) for t, _, r in events[1:]]
        window = (after[-1][0] - warm) if after else 0.0
        records = sum(r for _, r in after)
        out[model_cfg["name"]] = {
            "examples_per_s": records / window if window > 0 else 0.0,
            "ttfg_s": (backend.first_update - t0) if backend.first_update else None,
            "window_s": window, "window_records": records, "records": report.records_trained,
            "tasks": len(events), "workers_reporting": len(workers), "model_version": report.model_version,
            "job_s": report.seconds, "total_s": events[-1][0] - t0, "first_report_s": events[0][0] - t0,
            "staleness": getattr(report, "staleness", None), "log_dir": os.path.abspath(report.log_dir),
            "exports": getattr(report, "exports", {}),  # --export_every_secs (benchmarks/stream.py)
        }
    return out


# ---------------------------------------------------------------- ParameterServerStrategy


def _server_main(argv: list[str]) -> None:
    """A tf.distribute.Server: ``server CLUSTER_JSON JOB INDEX INTRA INTER``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cluster, job, index, intra, inter = json.loads(argv[0]), argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra, inter_op_parallelism_threads=inter)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc", config=config, start=True
    )
    server.join()


def run_pss(spec_json: dict) -> dict:
    tf = _configure_tf(1, spec_json.get("pss_inter_op", 2))  # the coordinator
    nw, nps, threads = spec_json["num_workers"], spec_json.get("num_ps", 1), spec_json["threads"]
    worker_threads = max(1, threads // nw)
    out = {}
    t0 = time.time()
    cluster = {
        "chief": [f"127.0.0.1:{free_port()}"],
        "worker": [f"127.0.0.1:{free_port()}" for _ in range(nw)],
        "ps": [f"127.0.0.1:{free_port()}" for _ in range(nps)],
    }
    procs = []
    for job, intra in (("ps", 1), ("worker", worker_threads)):
        for i in range(len(cluster[job])):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.training", "--server", json.dumps(cluster), job, str(i),
                 str(intra), str(spec_json.get("pss_inter_op", 2))],
                env=child_env(), stdin=subprocess.DEVNULL,
            ))
    try:
        # Connect once every server listens: connecting earlier only adds gRPC's
        # reconnect back-off (seconds) to PSS's start-up.
        _wait_listening([a for job in ("worker", "ps") for a in cluster[job]], procs)
        _log(f"pss: servers listening after {time.time() - t0:.1f}s")
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        _log(f"pss: cluster connected after {time.time() - t0:.1f}s")
        for model_cfg in spec_json["models"]:
            if out:  # later models share the cluster: start-up is the first model's
                t0 = time.time()
            out[model_cfg["name"]] = _pss_train(tf, strategy, coordinator, model_cfg, spec_json, t0)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    return out


def _wait_listening(addresses: list[str], procs, timeout: float = 300.0) -> None:
    import socket

    deadline = time.time() + timeout
    pending = list(addresses)
    while pending:
        if time.time() > deadline:
            raise TimeoutError(f"tf.distribute.Server processes not listening on {pending}")
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a tf.distribute.Server process exited")
        host, port = pending[0].rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            pending.pop(0)
        except OSError:
            time.sleep(0.05)


def _pss_train(tf, strategy, coordinator, model_cfg: dict, spec_json: dict, t0: float) -> dict:
    spec, params = _load(model_cfg)
    bs, nw = model_cfg["batch_size"], spec_json["num_workers"]
    import keras

    keras.backend.clear_session()  # as ModelSpec.build_model does; it cannot run inside the scope
    with strategy.scope():
        model = spec.model_fn(**params)
        optimizer = spec.optimizer()
        optimizer.build(model.trainable_variables)
    files = model_cfg["files"]
    _log(f"pss: model and optimizer on the PS after {time.time() - t0:.1f}s")

    def dataset_fn():
        return _dataset(tf, spec, files).repeat().batch(bs)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        def replica_step(features, labels):
            with tf.GradientTape() as tape:
                loss = spec.loss(labels, model(features, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        features, labels = next(it)
        return strategy.run(replica_step, args=(features, labels))

    total_steps = max(1, round(model_cfg["records"] * model_cfg["epochs"] / bs))
    warm_steps = min(total_steps - 1, spec_json["warmup_batches"] * nw)
    first = coordinator.schedule(step, args=(iterator,))
    for _ in range(warm_steps - 1):
        coordinator.schedule(step, args=(iterator,))
    _log(f"pss: {warm_steps} warm-up steps scheduled after {time.time() - t0:.1f}s")
    first.fetch()
    ttfg = time.time() - t0
    _log(f"pss: first step done after {ttfg:.1f}s")
    coordinator.join()
    warm = time.time()
    for _ in range(total_steps - warm_steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    end = time.time()
    records = (total_steps - warm_steps) * bs
    return {
        "examples_per_s": records / (end - warm), "ttfg_s": ttfg, "window_s": end - warm,
        "window_records": records, "records": total_steps * bs, "total_s": end - t0,
    }


RUNNERS = {"keras_fit": run_keras_fit, "elasticdl": run_elasticdl, "pss": run_pss}


def main() -> None:
    from elasticdl.launch.child import die_with_parent

    die_with_parent()  # no orphans if the benchmark is killed
    if len(sys.argv) > 1 and sys.argv[1] == "--server":
        _server_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(parser.parse_args().spec)
    os.environ.update(spec.get("env", {}))
    if "sequence" in spec:  # --quick: several competitors share this process (one TensorFlow import)
        result = {"sequence": [RUNNERS[s["competitor"]](s) for s in spec["sequence"]]}
    else:
        result = RUNNERS[spec["competitor"]](spec)
    emit(result)
    sys.stdout.flush()
    sys.stderr.flush()
    # A coordinator's exit races its servers' shutdown and logs errors; nothing is left to do.
    os._exit(0)


if __name__ == "__main__":
    main()
