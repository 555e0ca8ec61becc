"""The state of one job's pods, fed by watch events: an explicit transition table.

A pod is PENDING, RUNNING (READY once its port answers), EXITED (Succeeded, Failed,
deleted, or stuck on an image it cannot pull) and finally GONE (its object deleted).
Each transition may produce an *exit* (reported once to the job loop) or a *warning*
(a pod that stays unschedulable). Pure Python: tests feed it pod dicts.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from elasticdl.launch.kubernetes.manifests import INDEX_LABEL, ROLE_LABEL

# Waiting reasons after which a container never starts by itself.
FATAL_WAITING = {
    "ErrImagePull": "cannot pull its image",
    "ImagePullBackOff": "cannot pull its image",
    "InvalidImageName": "has an invalid image name",
    "ErrImageNeverPull": "has no local image and --image_pull_policy is Never",
    "CreateContainerConfigError": "has an invalid container configuration",
}


class PodPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    EXITED = "Exited"
    GONE = "Gone"


@dataclass(frozen=True)
class PodView:
    """What one pod dict says, in the terms the table needs."""

    name: str
    uid: str
    role: str
    index: int
    phase: str  # the API's status.phase
    ready: bool
    pod_ip: str
    terminating: bool
    exit_code: int | None
    reason: str
    message: str
    waiting_reason: str
    unschedulable: str  # the scheduler's message when it cannot place the pod


def view(pod: dict) -> PodView:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    exit_code, reason, message, waiting = None, status.get("reason", ""), status.get("message", ""), ""
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state:
            exit_code = state["terminated"].get("exitCode")
            reason = reason or state["terminated"].get("reason", "")
            message = message or state["terminated"].get("message", "")
        elif "waiting" in state:
            waiting = state["waiting"].get("reason", "")
            message = message or state["waiting"].get("message", "")
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = scheduled.get("message", "Unschedulable") if scheduled.get("status") == "False" else ""
    return PodView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), role=labels.get(ROLE_LABEL, ""), index=int(labels.get(INDEX_LABEL, "0") or 0),
        phase=status.get("phase", "Pending"), ready=ready, pod_ip=status.get("podIP", ""),
        terminating=bool(meta.get("deletionTimestamp")), exit_code=exit_code, reason=reason, message=message,
        waiting_reason=waiting, unschedulable=unschedulable,
    )


def normalize_exit_code(code: int) -> int:
    """A container's ``128+N`` (killed by signal N) as ``subprocess`` says it: ``-N``."""
    return -(code - 128) if 128 < code < 160 else code


@dataclass
class PodRecord:
    role: str
    index: int
    uid: str = ""  # the pod object we created; events of an older pod of the same name are ignored
    state: PodPhase = PodPhase.PENDING
    ready: bool = False
    pod_ip: str = ""
    pending_since: float = field(default_factory=time.monotonic)
    warned_pending: bool = False
    last: PodView | None = None


@dataclass(frozen=True)
class PodExit:
    name: str
    role: str
    index: int
    returncode: int
    reason: str
    message: str = ""


class PodTable:
    """Thread-safe: the watch thread calls ``on_event``; the job loop reads and drains."""

    def __init__(self, pending_warning_seconds: float = 60.0):
        self.pending_warning_seconds = pending_warning_seconds
        self.records: dict[str, PodRecord] = {}
        self._exits: list[PodExit] = []
        self._warnings: list[str] = []
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    # -------------------------------------------------------------- feeding

    def expect(self, name: str, role: str, index: int, uid: str = "") -> None:
        """A pod we just created: PENDING until the watch says otherwise."""
        with self._lock:
            self.records[name] = PodRecord(role, index, uid)
            self.changed.notify_all()

    def on_event(self, kind: str, obj) -> None:
        with self._lock:
            if kind == "SYNC":
                present = {(p.get("metadata") or {}).get("name") for p in obj}
                for pod in obj:
                    self._apply("MODIFIED", view(pod))
                for name, record in self.records.items():
                    if name not in present and record.state is not PodPhase.GONE and record.last is not None:
                        self._apply("DELETED", record.last)  # deleted while we were not watching
            else:
                self._apply(kind, view(obj))
            self.changed.notify_all()

    def _apply(self, kind: str, pod: PodView) -> None:
        record = self.records.get(pod.name)
        if record is None:
            if kind == "DELETED" or not pod.role:
                return
            record = self.records[pod.name] = PodRecord(pod.role, pod.index, pod.uid)  # e.g. a restarted master
        if record.uid and pod.uid and pod.uid != record.uid:
            return  # the previous pod of that name (a relaunched PS)
        record.last = pod
        if kind == "DELETED":
            if record.state is not PodPhase.EXITED and record.state is not PodPhase.GONE:
                code = normalize_exit_code(pod.exit_code) if pod.exit_code is not None else -9
                self._exit(pod, record, code, "Deleted", "the pod was deleted (preempted or by a user)")
            record.state = PodPhase.GONE
            record.ready = False
            return
        if record.state in (PodPhase.EXITED, PodPhase.GONE):
            return
        record.pod_ip = pod.pod_ip or record.pod_ip
        record.ready = pod.ready and not pod.terminating
        if pod.phase in ("Succeeded", "Failed"):
            code = normalize_exit_code(pod.exit_code) if pod.exit_code is not None else (0 if pod.phase == "Succeeded" else 1)
            # Ended while being deleted (preempted, scaled down): the deletion is the reason.
            reason = "Deleted" if pod.terminating else (pod.reason or pod.phase)
            self._exit(pod, record, code, reason, pod.message)
        elif pod.waiting_reason in FATAL_WAITING:
            self._exit(pod, record, 1, pod.waiting_reason,
                       f"{FATAL_WAITING[pod.waiting_reason]}: {pod.message}".rstrip(": "))
        elif pod.phase == "Running":
            record.state = PodPhase.RUNNING
        elif pod.unschedulable and not record.warned_pending:
            waited = time.monotonic() - record.pending_since
            if waited >= self.pending_warning_seconds:
                record.warned_pending = True
                self._warnings.append(
                    f"{pod.name} has been Pending for {waited:.0f}s: the scheduler says {pod.unschedulable!r}. "
                    "It starts when the cluster has room; lower the resource requests or the number of "
                    "pods otherwise."
                )

    def _exit(self, pod: PodView, record: PodRecord, code: int, reason: str, message: str) -> None:
        record.state = PodPhase.EXITED
        record.ready = False
        self._exits.append(PodExit(pod.name, record.role, record.index, code, reason, message))

    def check_pending(self) -> None:
        """Re-check unscheduled pods against the warning delay (no event comes while they wait)."""
        with self._lock:
            for record in self.records.values():
                if record.state is PodPhase.PENDING and record.last is not None:
                    self._apply("MODIFIED", record.last)

    # -------------------------------------------------------------- reading

    def drain_exits(self) -> list[PodExit]:
        with self._lock:
            exits, self._exits = self._exits, []
            return exits

    def drain_warnings(self) -> list[str]:
        with self._lock:
            warnings, self._warnings = self._warnings, []
            return warnings

    def alive(self, role: str) -> list[int]:
        with self._lock:
            return sorted(r.index for r in self.records.values()
                          if r.role == role and r.state in (PodPhase.PENDING, PodPhase.RUNNING))

    def get(self, name: str) -> PodRecord | None:
        with self._lock:
            return self.records.get(name)

    def wait_for(self, predicate, timeout: float) -> bool:
        """Wait until ``predicate(self.records)`` holds (called under the lock)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self.records):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 0.5))
            return True
