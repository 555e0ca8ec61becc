"""The simulator's only time and only concurrency: a seeded event queue with a simulated clock.

Every role is a generator (a coroutine) that yields what it waits for: a call to another
role (``Call``), a pause (``Sleep``), or a call's answer started earlier (``Await``). The
scheduler resumes one coroutine at a time, in simulated-time order; ties are broken by the
order the events were scheduled in, so a run is a function of its seed alone.
``random.Random(seed)`` (``Scheduler.rng``) is the only randomness.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any


class SimClock:
    """Simulated seconds; injected wherever the real code reads time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Future:
    """The answer to a call, once it came (``value``) or failed (``error``)."""

    done: bool = False
    value: Any = None
    error: BaseException | None = None
    waiters: list[Callable[[], None]] = field(default_factory=list)

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.done:
            return  # a duplicate answer, or the timeout came first
        self.done, self.value, self.error = True, value, error
        waiters, self.waiters = self.waiters, []
        for wake in waiters:
            wake()


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Await:
    future: Future


Coroutine = Generator[Any, Any, Any]


class Scheduler:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.clock = SimClock()
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.steps = 0

    def at(self, delay: float, action: Callable[[], None]) -> None:
        """Run ``action`` ``delay`` simulated seconds from now."""
        self._seq += 1
        heapq.heappush(self._queue, (self.clock.now + max(0.0, delay), self._seq, action))

    def step(self) -> bool:
        """Run the next event; False when none is left."""
        if not self._queue:
            return False
        when, _, action = heapq.heappop(self._queue)
        self.clock.now = max(self.clock.now, when)
        self.steps += 1
        action()
        return True


class Process:
    """A coroutine driven by the scheduler; ``kill()`` drops it wherever it waits.

    ``call`` is how the process's ``Call``-like requests are sent (the transport): it gets
    the request and returns a Future.
    """

    def __init__(self, scheduler: Scheduler, body: Coroutine, send: Callable[[Any], Future],
                 on_exit: Callable[[int, str], None]) -> None:
        self.scheduler = scheduler
        self.body = body
        self.send = send
        self.on_exit = on_exit
        self.alive = True
        self.frozen = False
        self._parked: Callable[[], None] | None = None  # a resume that came while frozen
        self._token = 0  # a resume belongs to the wait it was made for
        scheduler.at(0.0, lambda: self._resume(None, None, 0))

    def kill(self) -> None:
        self.alive = False
        self.body.close()

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False
        parked, self._parked = self._parked, None
        if parked is not None:
            self.scheduler.at(0.0, parked)

    def _resume(self, value: Any, error: BaseException | None, token: int) -> None:
        if not self.alive or token != self._token:
            return
        if self.frozen:  # SIGSTOP: it runs on from here once thawed
            self._parked = lambda: self._resume(value, error, token)
            return
        self._token += 1
        token = self._token
        try:
            request = self.body.throw(error) if error is not None else self.body.send(value)
        except StopIteration:
            self.alive = False
            self.on_exit(0, "")
            return
        except Exception as err:  # noqa: BLE001  a crash of the role: it exits non-zero
            self.alive = False
            self.on_exit(1, f"{type(err).__name__}: {err}")
            return
        if isinstance(request, Sleep):
            self.scheduler.at(request.seconds, lambda: self._resume(None, None, token))
            return
        future = request.future if isinstance(request, Await) else self.send(request)
        if isinstance(request, Await) or getattr(request, "blocking", True):
            self._wait(future, token)
        else:  # started, not awaited: the coroutine gets the future and goes on
            self.scheduler.at(0.0, lambda: self._resume(future, None, token))

    def _wait(self, future: Future, token: int) -> None:
        wake = lambda: self._resume(future.value, future.error, token)  # noqa: E731
        if future.done:
            self.scheduler.at(0.0, wake)
        else:
            # Woken through the queue, never from inside the role that answered.
            future.waiters.append(lambda: self.scheduler.at(0.0, wake))
