"""Who a checkpoint directory belongs to: one job, and the lineages it started there.

``<checkpoint_dir>/elasticdl-owner.json`` names the job that writes the directory and each
*lineage* of it: one start of the job with a fresh task ledger. A master that resumes the
ledger of its job (etcd kept it) continues the last lineage; a job that starts over (a new
run under the same name, or its etcd lost its data) starts a new one.

A lineage's checkpoint terms lie above every term on disk when it started: its term is
``term_base`` + the leadership term the state store gives it (which starts low again in a
fresh store). So a newer lineage's cuts always sort after an older one's, its files never
take an older lineage's names, and pruning and rollbacks, given the lineage's ``term_base``
as their floor, only ever touch its own cuts (elasticdl/model/checkpoint.py).

A second job (another name) on the directory is refused at submit: its cuts would overwrite
the owner's, and its pruning would remove them. A job that says it continues the directory
(``--checkpoint_dir_for_init`` inside it) takes it over: a new lineage, under its name, and
the cuts already there are kept.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field

from elasticdl import fs
from elasticdl.model.checkpoint import max_term
from elasticdl.model.checkpoint_integrity import CheckpointError

logger = logging.getLogger(__name__)

OWNER_FILE = "elasticdl-owner.json"


class CheckpointOwnerError(CheckpointError):
    """The checkpoint directory belongs to another job."""


@dataclass(frozen=True)
class Lineage:
    id: str
    job_name: str
    term_base: int  # the lineage's terms are above it (the highest term on disk when it started)
    started: float  # unix time


@dataclass
class Owner:
    job_name: str
    lineages: list[Lineage] = field(default_factory=list)

    @property
    def current(self) -> Lineage | None:
        return self.lineages[-1] if self.lineages else None

    def to_json(self) -> str:
        return json.dumps({"job_name": self.job_name, "lineages": [asdict(x) for x in self.lineages]}, indent=2)


def read_owner(checkpoint_dir: str) -> Owner | None:
    """The directory's owner; None when it has none (a new directory, or one of an older ElasticDL).
    CheckpointError for an owner file that is not one."""
    path = fs.join(checkpoint_dir, OWNER_FILE)
    if not fs.exists(path):
        return None
    try:
        data = json.loads(fs.read_bytes(path))
        return Owner(str(data["job_name"]),
                     [Lineage(str(x["id"]), str(x["job_name"]), int(x["term_base"]), float(x["started"]))
                      for x in data["lineages"]])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path} is not an ElasticDL owner file ({type(err).__name__}: {err}): remove it if this directory is "
            "yours, or give the job another --checkpoint_dir"
        ) from None


def continues(checkpoint_dir: str, init: str) -> bool:
    """True if ``init`` (--checkpoint_dir_for_init) is in ``checkpoint_dir``: the job says it continues it."""
    if not init or not checkpoint_dir:
        return False
    if fs.is_remote(checkpoint_dir):
        return init.rstrip("/") == checkpoint_dir.rstrip("/") or init.startswith(checkpoint_dir.rstrip("/") + "/")
    directory, init = os.path.abspath(checkpoint_dir), os.path.abspath(init)
    return init == directory or init.startswith(directory + os.sep)


def check_owner(checkpoint_dir: str, job_name: str, continuing: bool = False) -> Owner | None:
    """CheckpointOwnerError when ``checkpoint_dir`` belongs to a job other than ``job_name``, unless
    this job continues it (``continuing``: --checkpoint_dir_for_init in it)."""
    owner = read_owner(checkpoint_dir)
    if owner is not None and owner.job_name != job_name and not continuing:
        lineage = owner.current
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lineage.started)) if lineage else "?"
        raise CheckpointOwnerError(
            f"--checkpoint_dir {checkpoint_dir} belongs to job {owner.job_name!r} (lineage "
            f"{lineage.id if lineage else '?'}, started {since}): job {job_name!r} would overwrite and prune its "
            f"checkpoints. Give this job another --checkpoint_dir (with --checkpoint_dir_for_init {checkpoint_dir} "
            f"to start from that job's model), take the directory over with --checkpoint_dir_for_init "
            f"{checkpoint_dir} (that job's checkpoints are kept), or continue that job with --job_name {owner.job_name}"
        )
    return owner


def claim(checkpoint_dir: str, job_name: str, resumed: bool, continuing: bool = False) -> Lineage:
    """Make ``checkpoint_dir`` this job's; its lineage. A resumed job keeps its last lineage; a
    fresh start makes a new one above every term on disk. CheckpointOwnerError for another job's
    (unless ``continuing``: then it becomes this job's)."""
    owner = check_owner(checkpoint_dir, job_name, continuing) or Owner(job_name)
    if owner.job_name != job_name:
        logger.warning("job %s takes %s over from job %s (--checkpoint_dir_for_init in it); that job's "
                       "checkpoints are kept", job_name, checkpoint_dir, owner.job_name)
        owner.job_name = job_name
    elif resumed and owner.current is not None:
        logger.info("checkpoint lineage %s of job %s continues in %s", owner.current.id, job_name, checkpoint_dir)
        return owner.current
    lineage = Lineage(uuid.uuid4().hex[:12], job_name, max_term(checkpoint_dir), time.time())
    if owner.lineages or lineage.term_base:
        logger.info("a new checkpoint lineage %s in %s: the cuts already there (terms up to %d) are kept, never "
                    "pruned, and no rollback or resume of this run goes back to them", lineage.id, checkpoint_dir, lineage.term_base)
    owner.lineages.append(lineage)
    fs.makedirs(checkpoint_dir)
    text = owner.to_json().encode()
    fs.write_atomically(fs.join(checkpoint_dir, OWNER_FILE), lambda f: f.write(text))
    return lineage


def lineage_floor(checkpoint_dir: str, term: int) -> int:
    """The term floor of the lineage that ``term`` belongs to (its ``term_base``): what a PS of that
    term may prune or discard lies above it. -1 (every term) without an owner file."""
    try:
        owner = read_owner(checkpoint_dir)
    except CheckpointError as err:
        logger.warning("%s; pruning only this run's terms", err)
        return max(term - 1, -1)
    if owner is None:
        return -1
    bases = [x.term_base for x in owner.lineages if x.term_base < term]
    return max(bases) if bases else -1
