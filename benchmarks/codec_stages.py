"""Where the PS data plane's time goes, stage by stage, in one process (no network).

    python -m benchmarks.codec_stages [floats]      # default 10M floats in (1000, 1000) tensors

Times every step a dense model takes through ElasticDL's current code on its way
PS -> worker (pull) and worker -> PS (push): the copies the PS makes, tensor_codec,
protobuf message construction, serialization and parsing, gradient checks, the sync
strategy and the optimizer. Next to them, what a zero-copy framing would cost (one
join of the raw buffers on send, np.frombuffer views on receive), and a plain memcpy
of the same bytes. Medians of 5 runs, milliseconds and GB/s of model bytes.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np


def _time(fn, reps: int = 5) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str]) -> None:
    from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
    from elasticdl.proto import elasticdl_pb2
    from elasticdl.ps.parameters import ParameterShard
    from elasticdl.ps.strategies import AverageUpdatingStrategy
    from elasticdl.rpc import codec as tensor_codec

    floats = int(float(argv[0])) if argv else 10_000_000
    n = floats // 1_000_000
    params = {f"layer_{i}/kernel": np.random.default_rng(i).standard_normal((1000, 1000), np.float32)
              for i in range(n)}
    grads = {k: np.full_like(v, 1e-3) for k, v in params.items()}
    nbytes = 4 * n * 1_000_000
    shard = ParameterShard(make_optimizer(OptimizerSpec("SGD", {"learning_rate": 1e-6})))
    shard.initialize({k: v.copy() for k, v in params.items()})

    copies = {k: v.copy() for k, v in params.items()}
    tensors = tensor_codec.encode_dict(copies)
    response = elasticdl_pb2.PullDenseParametersResponse(initialized=True, version=1, dense_parameters=tensors)
    wire = response.SerializeToString()
    parsed = elasticdl_pb2.PullDenseParametersResponse.FromString(wire)
    grad_tensors = tensor_codec.encode_dict(grads)
    request = elasticdl_pb2.PushGradientsRequest(version=1, gradients=grad_tensors)
    push_wire = request.SerializeToString()
    push_parsed = elasticdl_pb2.PushGradientsRequest.FromString(push_wire)
    decoded_grads = tensor_codec.decode_list(push_parsed.gradients)

    def strategy_push():
        strategy = AverageUpdatingStrategy(1)
        shard.version = 0
        strategy.push(shard, decoded_grads, 0, None)

    buffers = [memoryview(v).cast("B") for v in params.values()]
    joined = b"".join(buffers)
    stages = [
        ("pull  PS: copy params under the lock (server.pull)", lambda: {k: v.copy() for k, v in params.items()}),
        ("pull  PS: tensor_codec.encode_dict (tobytes)", lambda: tensor_codec.encode_dict(copies)),
        ("pull  PS: build PullDenseParametersResponse", lambda: elasticdl_pb2.PullDenseParametersResponse(
            initialized=True, version=1, dense_parameters=tensors)),
        ("pull  PS: SerializeToString", lambda: response.SerializeToString()),
        ("pull  worker: FromString", lambda: elasticdl_pb2.PullDenseParametersResponse.FromString(wire)),
        ("pull  worker: tensor_codec.decode_list", lambda: tensor_codec.decode_list(parsed.dense_parameters)),
        ("push  worker: tensor_codec.encode_dict (tobytes)", lambda: tensor_codec.encode_dict(grads)),
        ("push  worker: build PushGradientsRequest", lambda: elasticdl_pb2.PushGradientsRequest(
            version=1, gradients=grad_tensors)),
        ("push  worker: SerializeToString", lambda: request.SerializeToString()),
        ("push  PS: FromString", lambda: elasticdl_pb2.PushGradientsRequest.FromString(push_wire)),
        ("push  PS: tensor_codec.decode_list", lambda: tensor_codec.decode_list(push_parsed.gradients)),
        ("push  PS: check_gradients (isfinite)", lambda: shard.check_gradients(decoded_grads)),
        ("push  PS: sync strategy, grads_to_wait=1 (copy, scale, SGD)", strategy_push),
        ("push  PS: SGD apply alone", lambda: shard.apply(decoded_grads, None)),
        ("alt   send: b''.join(raw buffers)", lambda: b"".join(buffers)),
        ("alt   receive: np.frombuffer views", lambda: [np.frombuffer(joined, np.float32, 1_000_000, i * 4_000_000)
                                                    for i in range(n)]),
        ("ref   memcpy into a preallocated array", lambda: [np.copyto(copies[k], v) for k, v in params.items()]),
    ]
    print(f"{n}M float32 ({nbytes / 1e6:.0f} MB) in {n} tensors; median of 5, ms and GB/s of model bytes")
    totals = {"pull": 0.0, "push": 0.0}
    for name, fn in stages:
        seconds = _time(fn)
        kind = name.split()[0]
        if kind in totals and "alone" not in name:
            totals[kind] += seconds
        print(f"  {name:<62} {seconds * 1e3:8.1f} ms  {nbytes / seconds / 1e9:6.2f} GB/s")
    for kind, seconds in totals.items():
        print(f"  {kind} total (Python-side work, no network)  {seconds * 1e3:8.1f} ms  "
              f"-> at most {nbytes / seconds / 1e6:,.0f} MB/s")


if __name__ == "__main__":
    main(sys.argv[1:])
