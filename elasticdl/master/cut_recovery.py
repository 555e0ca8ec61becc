"""The master going back to a checkpoint cut: which cut, and what the ledger then lacks.

``latest_cut`` picks the newest cut of this run's lineage whose shards verify, passing over
damaged ones (named in the log), and reads its data position without ever raising anything
but a log line: a truncated survivor shard must not crash the master.

``rewind_to_cut`` puts the ledger back to the cut's data position and counts what it could
not put back. The ledger keeps the done tasks of this epoch and the last one only (the
older ones would grow its state-store snapshot without end), so a rollback to a cut older
than the last epoch's start -- checkpoint writes failed for a while (a full disk), then a PS
died -- leaves the records of the epochs in between counted done and in no model. Before
this count, nothing said so: 8,590 such records were reported as 0 possibly missing. They
are the records the ledger still counts done beyond those the cut holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from elasticdl import fs
from elasticdl.data.kafka_address import stream_of
from elasticdl.master.recovery_policy import CutFound, possibly_missing
from elasticdl.master.task_manager import TaskManager
from elasticdl.model import checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CutPosition:
    path: str  # the version directory
    version: int
    marks: dict[int, int] = field(default_factory=dict)  # task id -> records applied up to (lowest over shards)
    records_applied: list[int] = field(default_factory=list)  # per shard, over the whole job


@dataclass(frozen=True)
class Rewound:
    retrained: int  # records the ledger put back to todo
    possibly_missing: int  # records it still counts done that the cut does not hold


def latest_cut(directory: str, floor: int = -1) -> CutPosition | None:
    """The newest usable cut under ``directory`` with terms above ``floor`` (this lineage's);
    None when there is none. Never raises for a damaged file: the next older cut serves."""
    for cut in cuts_found(directory, floor):
        if cut.verified:
            return CutPosition(cut.path, cut.version, cut.marks, list(cut.records_applied))
    return None


def cuts_found(directory: str, floor: int = -1) -> tuple[CutFound, ...]:
    """The facts for the recovery policy: this lineage's newest verified cut, after any whose data
    position could not be read (unverified). Damaged and partial cuts newer than it are passed over
    by ``checkpoint.usable_cuts`` (named in the log). Never raises for a damaged file."""
    found: list[CutFound] = []
    if not directory:
        return ()
    try:
        for cut in checkpoint.usable_cuts(directory, floor):
            try:
                version, marks, applied = checkpoint.cut_position(cut.directory)
            except checkpoint.CheckpointError as err:  # damaged after it verified
                logger.warning("passed over checkpoint %s: %s", cut.directory, err)
                found.append(CutFound(cut.directory, checkpoint.version_of(cut.directory), verified=False))
                continue
            found.append(CutFound(cut.directory, version, True, marks, tuple(applied)))
            break
    except OSError as err:  # the directory itself cannot be listed
        logger.error("could not look for a checkpoint in %s: %s", directory, err)
    return tuple(found)


def rewind_to_cut(tasks: TaskManager, cut: CutPosition, cause: str, skipped_bad_records: int = 0) -> Rewound:
    """Put the ledger back to ``cut``'s data position; what is trained again, and what is lost."""
    return rewind_ledger(tasks, cut.marks, cut.records_applied, cut.path, cause, skipped_bad_records)


def rewind_ledger(tasks: TaskManager, marks: dict[int, int], held: list[int] | tuple[int, ...], where: str,
                  cause: str, skipped_bad_records: int = 0) -> Rewound:
    """Put the ledger back to the data position ``marks`` the model now holds (``held`` records per
    shard, e.g. a cut's; none and ``{}`` when every PS started over); what is trained again, and
    what is lost.

    Each shard counts the records it applied (bad records skipped in a batch were pushed with it,
    hence ``skipped_bad_records``, as in the job's exactly-once check). Every record the ledger
    counts done beyond the fewest any shard holds may be missing from the model."""
    retrained = tasks.rewind(marks, cause=cause)
    credited = sum(e.records_done for e in tasks.epochs) + skipped_bad_records
    missing = possibly_missing(credited, held)
    if missing:
        logger.error(
            "%s holds %d records, the task ledger counts %d done: the updates of %d records of "
            "epochs before the last one are not in the model and are not trained again (checkpoints failed to "
            "be written for a while; see checkpoint_errors in the report). They are counted in "
            "records_possibly_missing", where, min(held), credited, missing)
    return Rewound(retrained, missing)


def discard_abandoned(directory: str, version: int, ps_ids, term: int, floor: int = -1) -> list[str]:
    """Remove the shard files of ``ps_ids`` after ``version`` in this lineage (terms in (``floor``,
    ``term``]): the timeline the job left when every PS started over, so that none of its files
    ever makes a cut with the new timeline's. The paths removed (logged)."""
    removed = []
    for ps_id in ps_ids:
        removed += checkpoint.discard_after(directory, version, ps_id, term, floor) if directory else []
    for path in removed:
        logger.info("removed %s: written before the job started over", path)
    for version_dir in sorted({path.rsplit("/", 1)[0] for path in removed}):
        # A version the new timeline may never write again; on a store without real directories
        # (object stores, the memory store) it went with its last file.
        if fs.exists(version_dir) and not fs.listdir(version_dir):
            fs.rmtree(version_dir)
    return removed


def read_cut(path: str) -> CutPosition | None:
    """The data position of the cut at ``path`` (a version directory); None, logged, if it cannot
    be read any more."""
    try:
        version, marks, applied = checkpoint.cut_position(path)
    except checkpoint.CheckpointError as err:
        logger.error("could not read the data position of checkpoint %s: %s", path, err)
        return None
    return CutPosition(path, version, marks, applied)


def skipped_bad_records(bad_records, training_files) -> int:
    """Bad records found in the training data: their batches were pushed with them. A stream's
    bad record names a partition of the stream the job reads."""
    paths = {path for path, _ in training_files}
    return sum(1 for r in bad_records if stream_of(r.path) in paths)
