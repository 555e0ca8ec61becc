"""Known bugs planted back, to show the simulator finds them (``--plant NAME``).

Each is the behaviour of the code before its fix, patched in for the duration of a ``with``:

- ``async-reconnect``: after a PS reconnected, the policy forgot the versions held (-1) but an
  async worker did not pull before its next push, so every push was refused "gradient computed
  on version -1" and the task was dropped (issue 25).
- ``tell-livelock``: a TellLiveWorkers that found a PS away was issued again at once inside the
  same feed, forever: the master never polled the exit that brings the PS back (issue 25).
- ``no-leveling``: a sync job's shards were never leveled to one version once training was
  over (LevelVersions): after faults they ended at different versions (issue 25).
- ``backup-twice`` (``--mode replicas``): a backup applied a forwarded update again when it came
  twice (a retransmission, or the primary's retry of a forward whose answer was lost): the
  backup's shard drifted from its primary's (issue 26).
- ``trust-watermark`` (``--mode stream``): the stream source took a partition's high watermark
  for its end and never read past it, so the records a broker left out of its watermark (Tansu
  0.6) were never trained (issue 27).
- ``hand-to-dead``: a request for a task that a worker sent before it died, served after the
  master handled its exit, got a task: it sat in doing for a process that no longer existed (the
  CI hang of test_e2e_kafka's worker kill, where no --task_timeout took it back either).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from elasticdl.master import controller as c
from elasticdl.master.dispatcher import TaskDispatcher
from elasticdl.master.leveling import Leveling
from elasticdl.master.stream_source import KafkaStreamSource
from elasticdl.ps.replication import BackupApplier, apply_entry
from elasticdl.worker.consistency import ConsistencyPolicy


def _reconnected_before_the_fix(self: ConsistencyPolicy) -> None:
    self._versions = [-1] * self.num_ps
    self._awaiting_update = [False] * self.num_ps
    self._fresh_from_push = False
    self._stale = False


def _must_pull_before_the_fix(self: ConsistencyPolicy) -> bool:
    if self._stale:
        return True
    if self._fresh_from_push or self.unpushed or self.in_flight:
        return False
    return not self.use_async or self.steps_since_pull >= self.get_model_steps


@contextlib.contextmanager
def _async_reconnect() -> Iterator[None]:
    saved = ConsistencyPolicy.ps_reconnected, ConsistencyPolicy.must_pull
    ConsistencyPolicy.ps_reconnected, ConsistencyPolicy.must_pull = _reconnected_before_the_fix, _must_pull_before_the_fix
    try:
        yield
    finally:
        ConsistencyPolicy.ps_reconnected, ConsistencyPolicy.must_pull = saved


@contextlib.contextmanager
def _tell_livelock() -> Iterator[None]:
    saved = c.Controller._on

    def on(self, event):
        decisions = saved(self, event)
        if isinstance(event, c.LiveWorkersNotTold):
            self._tell_held = False  # told again at once, inside the same feed
        return decisions

    c.Controller._on = on
    try:
        yield
    finally:
        c.Controller._on = saved


@contextlib.contextmanager
def _no_leveling() -> Iterator[None]:
    saved = Leveling.due

    def never(self, training_over: bool, zero_told: bool) -> bool:
        self.done = True  # the final end goes on as before the fix
        return False

    Leveling.due = never
    try:
        yield
    finally:
        Leveling.due = saved


@contextlib.contextmanager
def _backup_twice() -> Iterator[None]:
    saved = BackupApplier.receive

    def receive(self, entry) -> None:
        if entry.seq <= self.applied and not self.closed:  # the check it forgot: "a second copy: nothing"
            apply_entry(self.core, entry)
            return
        saved(self, entry)

    BackupApplier.receive = receive
    try:
        yield
    finally:
        BackupApplier.receive = saved


@contextlib.contextmanager
def _trust_watermark() -> Iterator[None]:
    saved = KafkaStreamSource.poll_once

    def poll_once(self) -> None:
        probe = self.topic.probe
        self.topic.probe = lambda starts, limit, wait=0.0: dict(starts)  # nothing found past the watermark
        try:
            saved(self)
        finally:
            self.topic.probe = probe

    KafkaStreamSource.poll_once = poll_once
    try:
        yield
    finally:
        KafkaStreamSource.poll_once = saved


@contextlib.contextmanager
def _hand_to_dead() -> Iterator[None]:
    saved = TaskDispatcher.recover_worker_tasks

    def recover(self, worker_id: int) -> None:
        saved(self, worker_id)
        self._gone.discard(worker_id)  # before the fix, nothing remembered a worker's exit

    TaskDispatcher.recover_worker_tasks = recover
    try:
        yield
    finally:
        TaskDispatcher.recover_worker_tasks = saved


PLANTS = {"async-reconnect": _async_reconnect, "tell-livelock": _tell_livelock, "no-leveling": _no_leveling,
          "backup-twice": _backup_twice, "trust-watermark": _trust_watermark,
          "hand-to-dead": _hand_to_dead}


def planted(name: str | None):
    """The context that plants bug ``name`` (none: a context that changes nothing)."""
    if name is None:
        return contextlib.nullcontext()
    if name not in PLANTS:
        raise ValueError(f"--plant must be one of {', '.join(PLANTS)}. Received: {name!r}")
    return PLANTS[name]()
