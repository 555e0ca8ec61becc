"""A prototype of the proposed PS wire format, to size the fix (not part of the table).

    python -m benchmarks.stream_ps_prototype [floats] [rounds]

A parameter server in a child process holds a dense model as numpy arrays and serves
it the way docs/benchmarks.md proposes: no protobuf around tensor bytes, the model
streamed in 1 MB messages (pull: unary-stream, push: stream-unary), every chunk copied
exactly once on each side (into gRPC's bytes, out of them into preallocated arrays),
SGD applied in place. Printed next to it, from the same run: the 1 MB-chunk echo
stream (Python gRPC's ceiling) and ElasticDL's current PS (a real elasticdl.ps.main).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

from benchmarks.common import child_env
from elasticdl.rpc.channel import bind_local, make_channel, make_server

CHUNK = 1 << 20
PULL, PUSH = "/proto.PS/Pull", "/proto.PS/Push"


def _layout(floats: int) -> list[tuple[str, int]]:
    n = floats // 1_000_000
    return [(f"layer_{i}/kernel", 1_000_000) for i in range(n)]


def _chunks(arrays: list[np.ndarray]):
    for array in arrays:
        view = memoryview(array).cast("B")
        for start in range(0, len(view), CHUNK):
            yield bytes(view[start:start + CHUNK])  # the one copy on the way out


def _fill(arrays: list[np.ndarray], messages) -> None:
    targets = [memoryview(a).cast("B") for a in arrays]
    index, offset = 0, 0
    for message in messages:
        target = targets[index]
        target[offset:offset + len(message)] = message  # the one copy on the way in
        offset += len(message)
        if offset == len(target):
            index, offset = index + 1, 0


def serve(floats: int) -> None:
    params = [np.random.default_rng(i).standard_normal(n, np.float32) for i, (_, n) in enumerate(_layout(floats))]
    grads = [np.empty_like(p) for p in params]
    tmp = [np.empty_like(p) for p in params]
    lock = threading.Lock()

    def pull(request, context):
        with lock:  # a real PS would snapshot per version; the chunks are copied under the lock here
            yield from _chunks(params)

    def push(requests, context):
        _fill(grads, requests)
        with lock:
            for p, g, t in zip(params, grads, tmp):
                np.multiply(g, np.float32(1e-6), out=t)
                p -= t
        return b"ok"

    class Handler(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method == PULL:
                return grpc.unary_stream_rpc_method_handler(pull)
            if details.method == PUSH:
                return grpc.stream_unary_rpc_method_handler(push)
            return None

    server = make_server()
    server.add_generic_rpc_handlers((Handler(),))
    port = bind_local(server)
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def main(argv: list[str]) -> None:
    if argv and argv[0] == "serve":
        serve(int(argv[1]))
        return
    floats = int(float(argv[0])) if argv else 10_000_000
    rounds = int(argv[1]) if len(argv) > 1 else 5
    nbytes = 4 * floats
    from elasticdl.rpc.auth import ensure_process_token

    # Every gRPC server needs a job token: the servers started below inherit this one.
    ensure_process_token(os.path.abspath(os.path.join("runs", "benchmarks", "prototype")))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.stream_ps_prototype", "serve", str(floats)],
                            stdout=subprocess.PIPE, text=True)
    from benchmarks.dataplane import _measure_echo_stream, _measure_elasticdl, _model, _start_ps, _wait_file
    from elasticdl.launch.local import LocalBackend
    from elasticdl.rpc.ps_client import PSClient

    workdir = os.path.abspath(os.path.join("runs", "benchmarks", "prototype"))
    os.makedirs(workdir, exist_ok=True)
    backend = LocalBackend(os.path.join(workdir, "logs"))
    ready = os.path.join(workdir, "echo.port")
    if os.path.exists(ready):
        os.remove(ready)
    echo_proc = subprocess.Popen([sys.executable, "-m", "benchmarks.echo_server", "--ready_file", ready],
                                 env=child_env())
    try:
        channel = make_channel(f"127.0.0.1:{int(proc.stdout.readline())}")
        pull, push = channel.unary_stream(PULL), channel.stream_unary(PUSH)
        local = [np.empty(n, np.float32) for _, n in _layout(floats)]
        grads = [np.full(n, 1e-3, np.float32) for _, n in _layout(floats)]
        from benchmarks.echo_server import echo_stub

        _, echo_stream, echo_channel = echo_stub(f"127.0.0.1:{_wait_file(ready)}")
        ps = PSClient([_start_ps(backend, workdir, 0)])
        params = _model(floats, 0)
        ps.push_model(params)
        edl_grads = {k: np.full_like(v, 1e-3) for k, v in params.items()}

        def proto_round():
            _fill(local, pull(b""))
            push(_chunks(grads))

        results = {"prototype": [], "raw_grpc_stream_1MB": [], "elasticdl_ps": []}
        for _ in range(3):
            proto_round()
            t0 = time.perf_counter()
            for _ in range(rounds):
                proto_round()
            results["prototype"].append(2 * nbytes * rounds / 1e6 / (time.perf_counter() - t0))
            results["raw_grpc_stream_1MB"].append(_measure_echo_stream(echo_stream, nbytes, rounds)["mb_per_s"])
            results["elasticdl_ps"].append(_measure_elasticdl(ps, edl_grads, nbytes, rounds)["mb_per_s"])
        print(f"{floats / 1e6:.0f}M float32, pull + push, MB/s of model bytes (median of 3 interleaved runs):")
        for name, values in results.items():
            print(f"  {name:<22} {statistics.median(values):7.0f}   runs {' '.join(f'{v:.0f}' for v in values)}")
        ps.close()
        echo_channel.close()
        channel.close()
    finally:
        backend.stop_all()
        proc.kill()
        echo_proc.kill()


if __name__ == "__main__":
    main(sys.argv[1:])
