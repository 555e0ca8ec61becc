"""The PS data plane: pull + push of a whole dense model through one real PS process.

    python -m benchmarks.dataplane --spec '{"sizes": [["10M", 10000000]], "reps": 3, ...}'

For each model size a real parameter server (``python -m elasticdl.ps.main``, started
by elasticdl's LocalBackend with the default job config: sync SGD, grads_to_wait=1,
plain SGD) is driven by ``elasticdl.rpc.ps_client.PSClient`` exactly as a worker
does: ``pull(version=-1)`` returns every parameter, ``push_gradients`` sends a gradient
for every parameter, which the PS checks and applies. One round moves the model twice
(PS -> client, client -> PS).

Next to it, in the same run and interleaved with it, the raw limit: a Python gRPC echo
server (``benchmarks/echo_server.py``, same server settings) returns a bytes message as
large as the model (``raw_grpc``, the shape of ElasticDL's messages), and streams the same
bytes back in 1 MB messages (``raw_grpc_stream``: Python gRPC's real ceiling, since very
large messages are slow). The physical reference below both (``raw_tcp``): a plain loopback
TCP socket, ``sendall`` of the model's bytes into ``recv_into`` a ready buffer, and back
(``_TcpEcho``: no gRPC, no framing, no allocation). One round moves the model twice in each
case. All figures are MB/s (10^6 bytes) of model bytes moved per second. ``elasticdl_bf16``
drives the same PS with ``--wire_dtype bfloat16``: its figure counts the model's float32 bytes,
half of which travel. ``elasticdl_tcp`` drives it with ``--tensor_transport tcp``: the same
calls as raw frames on the PS's socket (elasticdl/rpc/bulk.py) instead of gRPC streams.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from benchmarks.common import child_env, emit
from elasticdl.rpc.bulk import recv_into

TENSOR_FLOATS = 1_000_000  # the model is made of (1000, 1000) float32 variables (4 MB each)


def _model(floats: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out, i = {}, 0
    while floats > 0:
        n = min(TENSOR_FLOATS, floats)
        shape = (1000, n // 1000) if n % 1000 == 0 else (n,)
        out[f"layer_{i}/kernel"] = rng.standard_normal(shape, dtype=np.float32) * 0.01
        floats -= n
        i += 1
    return out


def _wait_file(path: str, timeout: float = 120.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            return int(open(path).read())
        time.sleep(0.05)
    raise TimeoutError(f"no {path} after {timeout:.0f}s")


def _start_ps(backend, workdir: str, index: int) -> str:
    from elasticdl.config import JobConfig

    config = os.path.join(workdir, "job_config.json")
    with open(config, "w") as f:
        # The PS also serves raw TCP (elasticdl_tcp); the gRPC clients do not use it.
        f.write(JobConfig.from_flags(job_name="bench-dataplane", log_level="WARNING",
                                     tensor_transport="tcp").to_json())
    optimizer = os.path.join(workdir, "optimizer.json")
    with open(optimizer, "w") as f:
        json.dump({"name": "SGD", "config": {"learning_rate": 1e-6}}, f)
    ready = os.path.join(workdir, f"ps-{index}.port")
    if os.path.exists(ready):
        os.remove(ready)  # a port file from an earlier run
    backend.start("ps", index, ["--job_config", config, "--optimizer_spec", optimizer,
                                "--ps_id", "0", "--ready_file", ready])
    return f"127.0.0.1:{_wait_file(ready)}"


def _measure_elasticdl(ps, grads: dict[str, np.ndarray], nbytes: int, rounds: int) -> dict:
    pull_s = push_s = 0.0
    for i in range(rounds + 1):  # the first round warms up
        t0 = time.perf_counter()
        pulled = ps.pull([-1])[0]
        t1 = time.perf_counter()
        answer = ps.push_gradients({0: grads}, [pulled.version], None, 0)[0]
        t2 = time.perf_counter()
        if not answer.accepted:
            raise RuntimeError(f"push rejected: {answer.reason}")
        if i:
            pull_s += t1 - t0
            push_s += t2 - t1
    mb = nbytes * rounds / 1e6
    return {"mb_per_s": 2 * mb / (pull_s + push_s), "pull_mb_per_s": mb / pull_s,
            "push_mb_per_s": mb / push_s, "round_s": (pull_s + push_s) / rounds}


STREAM_CHUNK = 1 << 20


def _measure_echo_stream(echo_stream, nbytes: int, rounds: int) -> dict:
    payload = memoryview(bytes(nbytes))
    chunks = [bytes(payload[i:i + STREAM_CHUNK]) for i in range(0, nbytes, STREAM_CHUNK)]

    def one_round():
        got = sum(len(reply) for reply in echo_stream(iter(chunks)))
        assert got == nbytes

    one_round()  # warm-up
    t0 = time.perf_counter()
    for _ in range(rounds):
        one_round()
    elapsed = time.perf_counter() - t0
    return {"mb_per_s": 2 * nbytes * rounds / 1e6 / elapsed, "round_s": elapsed / rounds}


def _measure_echo(echo, nbytes: int, rounds: int) -> dict:
    payload = bytes(nbytes)
    echo(payload)  # warm-up
    t0 = time.perf_counter()
    for _ in range(rounds):
        reply = echo(payload)
    elapsed = time.perf_counter() - t0
    assert len(reply) == nbytes
    return {"mb_per_s": 2 * nbytes * rounds / 1e6 / elapsed, "round_s": elapsed / rounds}


class _TcpEcho:
    """A loopback TCP echo in a thread: it receives ``nbytes`` into one buffer and sends them back.
    Socket calls release the GIL, so the two ends run in parallel as two processes would."""

    def __init__(self, nbytes: int):
        import socket
        import threading

        self.nbytes = nbytes
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(listener.getsockname())
        self.server, _ = listener.accept()
        listener.close()
        self.rounds = 0
        self._go = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        buf = memoryview(bytearray(self.nbytes))
        while True:
            self._go.acquire()
            if self.rounds < 0:
                return
            recv_into(self.server, buf)
            self.server.sendall(buf)

    def measure(self, rounds: int) -> dict:
        payload = memoryview(bytearray(self.nbytes))
        back = memoryview(bytearray(self.nbytes))
        elapsed = 0.0
        for i in range(rounds + 1):  # the first round warms up
            self._go.release()
            t0 = time.perf_counter()
            self.client.sendall(payload)
            recv_into(self.client, back)
            if i:
                elapsed += time.perf_counter() - t0
        return {"mb_per_s": 2 * self.nbytes * rounds / 1e6 / elapsed, "round_s": elapsed / rounds}

    def close(self) -> None:
        self.rounds = -1
        self._go.release()
        self._thread.join()
        self.client.close()
        self.server.close()


def run(spec: dict) -> dict:
    from benchmarks.echo_server import echo_stub
    from elasticdl.launch.local import LocalBackend
    from elasticdl.rpc.ps_client import PSClient

    workdir = os.path.abspath(spec["workdir"])
    os.makedirs(workdir, exist_ok=True)
    os.environ.update(child_env())
    backend = LocalBackend(os.path.join(workdir, "logs"))
    import subprocess

    ready = os.path.join(workdir, "echo.port")
    if os.path.exists(ready):
        os.remove(ready)
    echo_proc = subprocess.Popen([sys.executable, "-m", "benchmarks.echo_server", "--ready_file", ready],
                                 env=child_env(), stdin=subprocess.DEVNULL)
    results: dict = {}
    try:
        echo, echo_stream, echo_channel = echo_stub(f"127.0.0.1:{_wait_file(ready)}")
        clients, clients_bf16, clients_tcp = {}, {}, {}
        for index, (label, floats) in enumerate(spec["sizes"]):
            address = _start_ps(backend, workdir, index)
            ps = PSClient([address])
            # The same PS, its dense tensors in bfloat16 on the wire (--wire_dtype), or on raw TCP.
            clients_bf16[label] = PSClient([address], wire_dtype="bfloat16")
            clients_tcp[label] = PSClient([address], tensor_transport="tcp")
            params = _model(floats, seed=index)
            if not ps.push_model(params)[0]:
                raise RuntimeError("the PS refused the model")
            grads = {name: np.full_like(value, 1e-3) for name, value in params.items()}
            clients[label] = (ps, grads, 4 * floats)
            results[label] = {"elasticdl": [], "elasticdl_bf16": [], "elasticdl_tcp": [], "raw_grpc": [],
                              "raw_grpc_stream": [], "raw_tcp": [],
                              "bytes": 4 * floats, "tensors": len(params)}
            del params
        for rep in range(spec["reps"]):
            for label, (ps, grads, nbytes) in clients.items():
                rounds = spec["rounds"][label]
                order = ["raw_grpc", "elasticdl", "raw_grpc_stream", "raw_tcp", "elasticdl_bf16", "elasticdl_tcp"]
                shift = rep % len(order)
                for who in order[shift:] + order[:shift]:
                    if who == "raw_tcp":
                        tcp = _TcpEcho(nbytes)
                        try:
                            results[label][who].append(tcp.measure(rounds))
                        finally:
                            tcp.close()
                    elif who == "raw_grpc":
                        results[label][who].append(_measure_echo(echo, nbytes, rounds))
                    elif who == "raw_grpc_stream":
                        results[label][who].append(_measure_echo_stream(echo_stream, nbytes, rounds))
                    else:
                        client = {"elasticdl_bf16": clients_bf16, "elasticdl_tcp": clients_tcp}.get(who, {}).get(label, ps)
                        results[label][who].append(_measure_elasticdl(client, grads, nbytes, rounds))
        for ps, _, _ in clients.values():
            ps.close()
        for ps in [*clients_bf16.values(), *clients_tcp.values()]:
            ps.close()
        echo_channel.close()
    finally:
        backend.stop_all()
        echo_proc.terminate()
        echo_proc.wait()
    return results


def main() -> None:
    from elasticdl.launch.child import die_with_parent

    die_with_parent()  # no orphans if the benchmark is killed
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    emit(run(json.loads(parser.parse_args().spec)))


if __name__ == "__main__":
    main()
