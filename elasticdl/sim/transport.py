"""The in-memory network: calls between roles that may be dropped, delayed, duplicated and
reordered.

A role serves ``rpc_<method>`` methods (an ``Endpoint``). A call is delivered after a random
delay, runs to completion in one step (a gRPC handler), and its answer travels back after
another delay. A call to a role that is down fails with ``Unavailable`` (gRPC's UNAVAILABLE);
one to a frozen role waits for it, and a caller that waits longer than its timeout gets
``Unavailable`` too, as a dropped message does: the worker's client retries both the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from elasticdl.sim.scheduler import Future, Scheduler


class Unavailable(ConnectionError):
    """The role did not answer: down, frozen past the deadline, or the message was lost."""


@dataclass(frozen=True)
class Call:
    target: str  # "master", "ps-0", ...
    method: str
    args: tuple = ()
    blocking: bool = True  # False: the caller gets the Future and Awaits it later
    timeout: float = 5.0
    shard: int | None = None  # --ps_replicas: the shard a PS call is for (SHARD_HEADER); None: its own


@dataclass(frozen=True)
class Deferred:
    """A handler's answer that is not ready yet: sent once ``future`` resolves (a primary answers
    a push once every backup took its update)."""

    future: Future


class Endpoint(Protocol):
    alive: bool
    frozen: bool


@dataclass
class NetworkFaults:
    """Probabilities per message while faults are on (all 0 once the nemesis stops)."""

    drop: float = 0.0
    duplicate: float = 0.0
    max_delay: float = 0.002  # reordering comes from different delays


@dataclass
class Network:
    scheduler: Scheduler
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    faults: NetworkFaults = field(default_factory=NetworkFaults)
    parked: dict[str, list] = field(default_factory=dict)  # deliveries held by a frozen role
    messages: int = 0
    dropped: int = 0
    duplicated: int = 0

    def _delay(self) -> float:
        return 0.0005 + self.scheduler.rng.random() * self.faults.max_delay

    def _lost(self) -> bool:
        if self.faults.drop and self.scheduler.rng.random() < self.faults.drop:
            self.dropped += 1
            return True
        return False

    def send(self, call: Call) -> Future:
        future = Future()
        self.messages += 1
        self.scheduler.at(call.timeout, lambda: future.resolve(
            error=Unavailable(f"{call.target}.{call.method}: no answer within {call.timeout:g}s")))
        if not self._lost():
            self.scheduler.at(self._delay(), lambda: self._deliver(call, future))
            if self.faults.duplicate and self.scheduler.rng.random() < self.faults.duplicate:
                self.duplicated += 1  # a retransmission: the role serves it twice, the caller hears one
                self.scheduler.at(self._delay() * 3, lambda: self._deliver(call, Future()))
        return future

    def _deliver(self, call: Call, future: Future) -> None:
        endpoint = self.endpoints.get(call.target)
        if endpoint is None or not endpoint.alive:
            self._answer(future, None, Unavailable(f"{call.target} is down"))
            return
        if endpoint.frozen:
            self.parked.setdefault(call.target, []).append((call, future))
            return
        try:
            if call.shard is not None:  # ShardRouter: served only where the shard's primary is
                endpoint = endpoint.for_shard(call.shard)
            value, error = getattr(endpoint, "rpc_" + call.method)(*call.args), None
        except Unavailable as err:
            value, error = None, err
        if isinstance(value, Deferred):
            later = value.future
            later.waiters.append(lambda: self._answer(future, later.value, later.error))
            return
        self._answer(future, value, error)

    def _answer(self, future: Future, value: Any, error: BaseException | None) -> None:
        if self._lost():
            return
        self.scheduler.at(self._delay(), lambda: future.resolve(value, error))

    def thawed(self, target: str) -> None:
        """Serve what arrived while ``target`` was frozen, in order."""
        for call, future in self.parked.pop(target, []):
            self.scheduler.at(0.0, lambda c=call, f=future: self._deliver(c, f))

    def killed(self, target: str) -> None:
        self.parked.pop(target, None)
