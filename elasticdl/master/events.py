"""The master's vocabulary: the events the controller takes and the decisions it returns.

Events come from the executor (a role exited, a task was reported, a timer fired, and the
answer to each decision the controller asked for); decisions go back to it (start or stop a
role, relaunch a PS, end an epoch, ...). Plain frozen dataclasses, so that the controller, the
job's executor and the simulator (``elasticdl.sim``) share one language, and
docs/architecture.md's tables are checked against them (tests/test_docs.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from elasticdl.errors import ElasticDLError
from elasticdl.launch.exits import ProcessExit
from elasticdl.master.evaluation_service import EvaluationResult
from elasticdl.master.instance_manager import Launch, Stop

__all__ = [
    "AddBackup",
    "BackupAdded",
    "BackupNotAdded",
    "BackupPromoted",
    "Decision",
    "DropSnapshot",
    "EndEpoch",
    "EpochEndDeferred",
    "EpochEndFired",
    "EpochEnded",
    "Event",
    "Fail",
    "FenceHandouts",
    "Finish",
    "FireEpochBegin",
    "FireEpochEnd",
    "HandoutsFenced",
    "LevelVersions",
    "LiveWorkersNotTold",
    "OpenEpoch",
    "PSRelaunched",
    "PSRollback",
    "PSSilent",
    "PromoteBackup",
    "PromotionFailed",
    "Phase",
    "RecordEvaluation",
    "RelaunchPS",
    "ReplacePS",
    "ReplaceWorker",
    "RoleExited",
    "SaveLedger",
    "ScaleRequested",
    "SnapshotFailed",
    "SnapshotTaken",
    "StopRequested",
    "StoreLost",
    "TakeSnapshot",
    "TaskReported",
    "TellLiveWorkers",
    "Tick",
    "VersionChanged",
    "VersionReported",
    "VersionsLeveled",
    "VersionsNotLeveled",
    "describe_exit",
]

class Phase(enum.StrEnum):
    """Where the job is, as the controller sees it (logged at each change; in the report)."""

    RUNNING = "running"  # tasks are handed out (train: an epoch's; evaluate, predict: theirs)
    ENDING_EPOCH = "ending epoch"  # an epoch's end is asked for (or waits for a PS that is away)
    SCALED_TO_ZERO = "scaled to zero"  # no worker wanted: waiting for `elasticdl scale`
    FINAL_EVALUATION = "final evaluation"  # every task is done, evaluation rounds are left
    LEAVING = "leaving"  # everything is done: the workers are told to leave
    FINISHED = "finished"
    FAILED = "failed"


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Tick:
    """Time passed (the job's poll interval): re-check what is due."""


@dataclass(frozen=True)
class RoleExited:
    exit: ProcessExit


@dataclass(frozen=True)
class TaskReported:
    task_id: int
    worker_id: int
    accepted: bool


@dataclass(frozen=True)
class VersionReported:
    """A worker's progress report or the job's PS poll saw this model version."""

    version: int


@dataclass(frozen=True)
class ScaleRequested:
    num_workers: int


@dataclass(frozen=True)
class StopRequested:
    """A callback asked to end training early (``stop_training`` or ``model.stop_training``)."""

    reason: str


@dataclass(frozen=True)
class StoreLost:
    """The state store cannot be trusted any more (the leader lock or the ledger is lost)."""

    reason: str


@dataclass(frozen=True)
class EpochEnded:
    """The job carried out ``EndEpoch``."""

    epoch: int


@dataclass(frozen=True)
class EpochEndFired:
    """The job carried out ``FireEpochEnd`` (and what the callbacks asked, e.g. to stop)."""

    epoch: int


@dataclass(frozen=True)
class EpochEndDeferred:
    """``EndEpoch`` found a PS unreachable (relaunching): nothing was done, ask again later."""

    epoch: int


@dataclass(frozen=True)
class LiveWorkersNotTold:
    """``TellLiveWorkers`` found a PS unreachable: tell it again later."""


@dataclass(frozen=True)
class VersionsLeveled:
    """The answer to ``LevelVersions``: every PS is at ``version``."""

    version: int


@dataclass(frozen=True)
class VersionsNotLeveled:
    """``LevelVersions`` found a PS unreachable (or gradients still pending): ask again later."""


@dataclass(frozen=True)
class HandoutsFenced:
    """The answer to ``FenceHandouts``: the PS refuse those hand-outs' pushes from now on, and
    applied each task's records up to ``marks[task_id]`` (None: a PS could not be asked)."""

    handouts: tuple[int, ...]
    marks: dict[int, int] | None


@dataclass(frozen=True)
class SnapshotTaken:
    """The answer to ``TakeSnapshot``: every PS holds snapshot ``round_id`` of model ``version``."""

    round_id: int
    version: int


@dataclass(frozen=True)
class SnapshotFailed:
    """The answer to ``TakeSnapshot`` when a PS did not answer (it is being relaunched)."""

    round_id: int
    reason: str = ""


@dataclass(frozen=True)
class PSSilent:
    """A probe of every PS completed: these did not answer within its deadline (none: all did).
    A frozen or hung PS is silent; a dead one is not (its exit tells)."""

    indices: tuple[int, ...]


@dataclass(frozen=True)
class PSRelaunched:
    """The job carried out ``RelaunchPS``: the PS restores checkpoint ``restored_version``
    (None: no checkpoint, it starts empty and the workers give it their copy)."""

    index: int
    restored_version: int | None
    retrained: int = 0  # records the ledger put back to todo (the cut's data position)
    missing: int = 0  # no checkpoint: records whose updates may be missing on the PS's shard


# --ps_replicas (docs/replicas.md; decided in elasticdl/master/failover.py)


@dataclass(frozen=True)
class PromoteBackup:
    """Decision: PS ``dead`` died. Each ``(shard, ps)`` of ``promotions``: that PS's backup of the
    shard becomes its primary (under the master's term, which the PS checks); ``backups``: every
    shard's live backups after (the primaries stop forwarding to the dead PS); ``primary``: the
    routing table after (shard -> PS), ``routes_version`` its version (workers take the newest).
    No promotions: a fallback to the cut, the backup lists emptied first."""

    dead: int
    promotions: tuple[tuple[int, int], ...]
    backups: tuple[tuple[int, ...], ...]
    primary: tuple[int, ...]
    routes_version: int
    fallback: bool = False  # a shard lost every replica: every PS back on its own shard, no backups
    # A fallback: the live PS that hold no caught-up replica of their own shard (a spare still
    # catching up), whose shard is lost with the dead PS's.
    lost: tuple[int, ...] = ()


@dataclass(frozen=True)
class AddBackup:
    """Decision: PS ``ps`` (relaunched as a spare) becomes a backup of ``shards``: it learns its
    peers, each shard's primary sends it a snapshot and forwards every later update to it."""

    ps: int
    shards: tuple[int, ...]
    primary: tuple[int, ...]  # the routing table (shard -> PS)
    routes_version: int


@dataclass(frozen=True)
class BackupAdded:
    """Event: the answer to ``AddBackup``: PS ``ps`` caught up on ``shards``. ``complete=False``:
    only on these; the catch-up of the decision's other shards failed (a ``BackupNotAdded``
    follows), and the next ``AddBackup`` asks for those only: a shard caught up is not prepared
    again, which would drop the backup its primary already forwards to."""

    ps: int
    shards: tuple[int, ...]
    complete: bool = True


@dataclass(frozen=True)
class BackupNotAdded:
    """Event: ``AddBackup`` failed (the spare not serving yet, a sync average in progress): asked
    again at the next ``Tick``."""

    ps: int
    reason: str


@dataclass(frozen=True)
class BackupPromoted:
    """Event: the answer to ``PromoteBackup``; ``versions``: each promoted shard's model version."""

    dead: int
    promotions: tuple[tuple[int, int], ...]
    versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromotionFailed:
    """Event: a PS refused or did not answer a promotion (another one died too, or a newer
    master took over): the job falls back to the cut (``RelaunchPS``)."""

    dead: int
    reason: str


Event = (
    Tick | RoleExited | TaskReported | VersionReported | ScaleRequested | StopRequested | StoreLost
    | EpochEnded | EpochEndDeferred | LiveWorkersNotTold | PSRelaunched | EpochEndFired | HandoutsFenced
    | SnapshotTaken | SnapshotFailed | PSSilent | VersionsLeveled | VersionsNotLeveled
    | BackupPromoted | PromotionFailed | BackupAdded | BackupNotAdded  # --ps_replicas (master/failover.py)
)


# ---------------------------------------------------------------- decisions
# Launch(index, priority) and Stop(index) come from the instance manager as they are.


@dataclass(frozen=True)
class RelaunchPS:
    """Start the PS that exited again, on its address (from the latest checkpoint, if any).
    ``moved_to``: (shard, PS) of the shards whose backup was promoted (--ps_replicas): the PS
    comes back as a spare serving none of them, and nothing is rolled back."""

    exit: ProcessExit
    moved_to: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ReplaceWorker:
    """Kill a worker that stopped making progress (its task timed out, or it did not leave after
    the job's end); its exit refills its slot, as for a preempted worker."""

    index: int
    reason: str


@dataclass(frozen=True)
class ReplacePS:
    """Kill a PS that stopped answering (silent past ``PS_SILENT_SECONDS``); its exit brings the
    usual relaunch (``RelaunchPS``), from the latest checkpoint."""

    index: int
    reason: str


@dataclass(frozen=True)
class FenceHandouts:
    """Tasks were taken back from their workers: every PS refuses these hand-outs' pushes from
    now on and says how far each task was applied. Answered by ``HandoutsFenced``."""

    handouts: tuple[int, ...]
    task_ids: tuple[int, ...]


@dataclass(frozen=True)
class TellLiveWorkers:
    """Sync mode: the PS average over the workers holding a task, never wait for absent ones."""

    count: int


@dataclass(frozen=True)
class LevelVersions:
    """Sync, once training is over and 0 live workers were told: every PS moves up to the
    highest shard's version, so that the job ends and is cut at one version (shards group
    the same gradients into versions differently after faults: docs/consistency.md).
    Answered by ``VersionsLeveled`` or ``VersionsNotLeveled``."""


@dataclass(frozen=True)
class EndEpoch:
    """Log the epoch's consistency telemetry; with ``sync_model``, pull the model for the callbacks.

    Answered by ``EpochEnded`` or ``EpochEndDeferred``."""

    epoch: int
    final: bool
    sync_model: bool


@dataclass(frozen=True)
class FireEpochBegin:
    epoch: int


@dataclass(frozen=True)
class FireEpochEnd:
    """``callbacks.on_epoch_end`` with the epoch's loss and ``metrics``, on the parameters of
    evaluation round ``snapshot`` (0: the model as pulled by ``EndEpoch``)."""

    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)
    snapshot: int = 0


@dataclass(frozen=True)
class OpenEpoch:
    """Hand out the epoch's training tasks (after ``FireEpochBegin``: a learning rate set by
    epoch applies to all of them)."""

    epoch: int


@dataclass(frozen=True)
class VersionChanged:
    """Tell callbacks (``on_model_version``) and TensorBoard about a new model version."""

    version: int


@dataclass(frozen=True)
class RecordEvaluation:
    """An evaluation round finished: TensorBoard scalars."""

    result: EvaluationResult


@dataclass(frozen=True)
class TakeSnapshot:
    """Every PS copies its parameters as snapshot ``round_id`` (an evaluation round's, which
    workers pull while training goes on). Answered by ``SnapshotTaken`` or ``SnapshotFailed``."""

    round_id: int


@dataclass(frozen=True)
class DropSnapshot:
    """Free an evaluation round's snapshot on the PS (``best_effort``: one may be gone already)."""

    round_id: int
    best_effort: bool = False


@dataclass(frozen=True)
class SaveLedger:
    """The task ledger moved: write it to the state store."""


@dataclass(frozen=True)
class Finish:
    """Every task and evaluation is done and every worker has left."""


@dataclass(frozen=True)
class Fail:
    error: str
    # The error the job raises (its class gives the exit code); None: JobFailedError(error).
    cause: ElasticDLError | None = field(default=None, compare=False)


Decision = (
    Launch | Stop | RelaunchPS | ReplacePS | ReplaceWorker | FenceHandouts | TellLiveWorkers | LevelVersions | EndEpoch | FireEpochBegin | FireEpochEnd | VersionChanged
    | RecordEvaluation | TakeSnapshot | DropSnapshot | SaveLedger | Finish | Fail | OpenEpoch
    | PromoteBackup | AddBackup  # --ps_replicas (elasticdl/master/failover.py)
)


@dataclass(frozen=True)
class PSRollback:
    """PS ``ps`` died at ``from_version``. With a checkpoint, every PS went back to the cut at
    ``to_version`` and the ledger to its data position: ``records_retrained`` records are
    trained again and none is lost. Without (``to_version`` None), the PS restarted empty and
    was refilled from a worker's copy: up to ``records_possibly_missing`` records' updates on
    its shard are not in the model."""

    ps: int
    from_version: int
    to_version: int | None
    records_retrained: int = 0
    records_possibly_missing: int = 0

    def to_dict(self) -> dict:
        return {"ps": self.ps, "from_version": self.from_version, "to_version": self.to_version,
                "records_retrained": self.records_retrained,
                "records_possibly_missing": self.records_possibly_missing}


def describe_exit(exit_: ProcessExit, what: str) -> str:
    tail = "\n".join("    " + line for line in exit_.log_tail.rstrip().splitlines()[-12:])
    return f"{exit_.role}-{exit_.index} {what} (exit code {exit_.returncode}); its last lines:\n{tail}"
