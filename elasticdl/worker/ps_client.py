"""A worker's view of all parameter servers: pulls and pushes go to every PS in parallel."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elasticdl import tensor_codec
from elasticdl.grpc_utils import make_channel, wait_for_channel
from elasticdl.proto import elasticdl_pb2, elasticdl_pb2_grpc
from elasticdl.sharding import ps_for_variable


@dataclass(frozen=True)
class PullResult:
    initialized: bool
    version: int
    params: dict[str, np.ndarray]


@dataclass(frozen=True)
class PushAnswer:
    accepted: bool
    version: int
    reason: str
    applied: bool = True


@dataclass(frozen=True)
class PSStats:
    """One PS's update counters since it started."""

    version: int
    pushes_accepted: int
    pushes_rejected_stale: int
    pushes_rejected_invalid: int
    staleness: dict[int, int]  # staleness of applied gradients -> count
    grads_to_wait: int


class PSClient:
    def __init__(self, addresses: list[str], connect_timeout: float = 60.0):
        self.addresses = addresses
        self._channels = [make_channel(a) for a in addresses]
        for channel, address in zip(self._channels, addresses):
            wait_for_channel(channel, address, connect_timeout)
        self._stubs = [elasticdl_pb2_grpc.PServerStub(c) for c in self._channels]

    @property
    def num_ps(self) -> int:
        return len(self._stubs)

    def split(self, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        parts: list[dict[str, np.ndarray]] = [{} for _ in self._stubs]
        for name, value in arrays.items():
            parts[ps_for_variable(name, self.num_ps)][name] = value
        return parts

    def pull(
        self, versions: list[int], wait_for_newer: list[bool] | None = None, timeout: float = 30.0
    ) -> list[PullResult]:
        """Pull from every PS; where ``wait_for_newer[i]``, PS i answers once its model moved."""
        waits = wait_for_newer or [False] * len(versions)
        futures = [
            stub.pull_dense_parameters.future(
                elasticdl_pb2.PullDenseParametersRequest(
                    version=v, wait_for_newer=w, timeout_seconds=timeout if w else 0.0
                )
            )
            for stub, v, w in zip(self._stubs, versions, waits)
        ]
        results = []
        for future in futures:
            reply = future.result()
            results.append(
                PullResult(reply.initialized, reply.version, tensor_codec.decode_list(reply.dense_parameters))
            )
        return results

    def push_model(self, params: dict[str, np.ndarray], version: int = 0) -> list[bool]:
        futures = [
            stub.push_model.future(
                elasticdl_pb2.Model(version=version, dense_parameters=tensor_codec.encode_dict(part))
            )
            for stub, part in zip(self._stubs, self.split(params))
        ]
        return [f.result().accepted for f in futures]

    def push_gradients(
        self,
        grads_by_ps: dict[int, dict[str, np.ndarray]],
        versions: list[int],
        learning_rate: float,
        worker_id: int,
    ) -> dict[int, PushAnswer]:
        """Push each PS its part (every PS gets a push, even an empty one, so versions stay in step)."""
        futures = {
            ps: self._stubs[ps].push_gradients.future(
                elasticdl_pb2.PushGradientsRequest(
                    worker_id=worker_id,
                    version=versions[ps],
                    learning_rate=learning_rate,
                    gradients=tensor_codec.encode_dict(part),
                )
            )
            for ps, part in grads_by_ps.items()
        }
        answers = {}
        for ps, future in futures.items():
            reply = future.result()
            answers[ps] = PushAnswer(reply.accepted, reply.version, reply.reason, reply.applied)
        return answers

    def save_checkpoint(self) -> list[str]:
        futures = [s.save_checkpoint.future(elasticdl_pb2.SaveCheckpointRequest()) for s in self._stubs]
        return [f.result().path for f in futures]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def pull_snapshot(self, snapshot_id: int) -> list[PullResult]:
        futures = [
            stub.pull_dense_parameters.future(elasticdl_pb2.PullDenseParametersRequest(snapshot_id=snapshot_id))
            for stub in self._stubs
        ]
        return [
            PullResult(r.initialized, r.version, tensor_codec.decode_list(r.dense_parameters))
            for r in (f.result() for f in futures)
        ]

    def take_snapshot(self, snapshot_id: int) -> int:
        """Freeze the parameters on every PS; returns the (lowest) version frozen."""
        futures = [s.take_snapshot.future(elasticdl_pb2.Snapshot(snapshot_id=snapshot_id)) for s in self._stubs]
        return min(f.result().version for f in futures)

    def drop_snapshot(self, snapshot_id: int) -> None:
        futures = [s.drop_snapshot.future(elasticdl_pb2.Snapshot(snapshot_id=snapshot_id)) for s in self._stubs]
        for future in futures:
            future.result()

    def set_learning_rate(self, learning_rate: float) -> None:
        futures = [s.set_learning_rate.future(elasticdl_pb2.LearningRate(value=learning_rate)) for s in self._stubs]
        for future in futures:
            future.result()

    def set_live_workers(self, count: int) -> None:
        futures = [s.set_live_workers.future(elasticdl_pb2.LiveWorkers(count=count)) for s in self._stubs]
        for future in futures:
            future.result()

    def stats(self) -> list[PSStats]:
        futures = [s.get_stats.future(elasticdl_pb2.Empty()) for s in self._stubs]
        return [
            PSStats(
                version=r.version,
                pushes_accepted=r.pushes_accepted,
                pushes_rejected_stale=r.pushes_rejected_stale,
                pushes_rejected_invalid=r.pushes_rejected_invalid,
                staleness={c.staleness: c.count for c in r.staleness},
                grads_to_wait=r.grads_to_wait,
            )
            for r in (f.result() for f in futures)
        ]
