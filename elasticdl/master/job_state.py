"""The job's state store as the master uses it: leader lock, resumed ledger, ledger writes.

One code path with or without etcd: ``--etcd_endpoints`` puts the state in etcd (a
restarted master resumes it), otherwise the embedded in-memory store holds it (nothing
outlives the master). Only training jobs keep a ledger in etcd; ``evaluate`` and
``predict`` always run on the in-memory store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

from elasticdl import store
from elasticdl.config import JobConfig
from elasticdl.errors import JobFailedError
from elasticdl.master.task_manager import TaskManager
from elasticdl.model import checkpoint_owner

logger = logging.getLogger(__name__)

# The master's leader lock in etcd expires this long after the master dies. The master stops
# acting when it could not renew the lock for 2/3 of this (elasticdl/store/leadership.py), so an
# etcd restart of a few seconds passes, and a longer outage ends the job before another master
# could take over.
LEADER_LEASE_SECS = 10.0


def job_fingerprint(config: JobConfig, files: list[tuple[str, int]]) -> str:
    """What makes a ledger this job's: its data, task size, epochs and model."""
    text = json.dumps(
        [files, config.effective_records_per_task, config.training.num_epochs, config.training.model_def]
    )
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]  # a name, not a secret


class JobState:
    """Opens the store, takes the leader lock, resumes and writes the task ledger.

    ``on_lost(reason)`` is called (from a store thread) when the lock or the ledger can no
    longer be trusted; the job turns it into a ``StoreLost`` event.
    """

    def __init__(self, config: JobConfig, command: str, fingerprint: str, on_lost: Callable[[str], None]):
        self.config = config
        self.fingerprint = fingerprint
        self.in_etcd = bool(config.elasticity.etcd_endpoints) and command == "train"
        self.keeps_ledger = command == "train"
        self._on_lost = on_lost
        self.lost = ""  # why the store can no longer be trusted
        self._lost_at = 0.0
        self._store = None
        self._ledger = None
        self._leadership = None
        self.resumed = False
        # The checkpoint lineage this run writes (elasticdl/model/checkpoint_owner.py); None
        # without --checkpoint_dir or for evaluate and predict, which only read checkpoints.
        self.lineage: checkpoint_owner.Lineage | None = None

    @property
    def term(self) -> int:
        """The leadership term: the lock key's create revision, higher for every new leader, above
        the checkpoint lineage's base (a fresh store starts its revisions low again, and a new
        lineage's cuts must sort after every older one's). The PS refuse commands of an older
        term, and each term writes its own checkpoint files."""
        revision = self._leadership.revision if self._leadership is not None else 0
        return revision + self.lineage.term_base if self.lineage is not None else revision

    @property
    def term_floor(self) -> int:
        """The terms of this run's checkpoint lineage lie above it: a rollback or a resume restores,
        and the PS prune, only cuts above it. -1 (any) without a lineage."""
        return self.lineage.term_base if self.lineage is not None else -1

    @property
    def outages(self) -> list:
        """Every etcd outage of this run, an ongoing one included; a lost leader lock is one too
        (the lease could not be renewed), even when no ledger write had failed yet."""
        outages = self._ledger.outages_so_far if self._ledger is not None else []
        if self.lost and not any(o.ongoing for o in outages):
            outages = [*outages, store.Outage(self._lost_at, time.time() - self._lost_at, self.lost, 0, True)]
        return outages

    @property
    def persisted_seq(self) -> int:
        """The newest ledger seq written to the store (-1: none yet): a stream's tasks cut before it
        may be handed out (elasticdl/master/stream_tasks.py)."""
        return self._ledger.persisted_seq if self._ledger is not None else -1

    def open(self, tasks: TaskManager | None) -> bool:
        """Take the lock and restore ``tasks`` from a stored ledger; True if the job resumed."""
        cfg = self.config
        if self.in_etcd:
            self._store = store.EtcdStateStore(cfg.elasticity.etcd_endpoints, cfg.job.job_name)
        else:
            self._store = store.MemoryStateStore(cfg.job.job_name)
            logger.info("job state in memory (no --etcd_endpoints): a restarted master starts over")
        try:
            # Wait a little: a master restarted after a crash finds its predecessor's lease
            # still alive until it expires.
            self._leadership = self._store.acquire_leadership(
                f"{os.uname().nodename}:{os.getpid()}", ttl=LEADER_LEASE_SECS, wait=1.5 * LEADER_LEASE_SECS,
                on_lost=self._lost,
            )
        except store.LeadershipError as err:
            raise JobFailedError(str(err)) from None
        except store.StoreUnavailableError as err:
            raise JobFailedError(f"etcd at {','.join(cfg.elasticity.etcd_endpoints)} is unreachable: {err}") from None
        if not self.keeps_ledger:
            return False
        resumed = self._open_ledger(tasks)
        if cfg.checkpoints.checkpoint_dir:  # resumed or not, before any PS writes to it
            directory = cfg.checkpoints.checkpoint_dir
            self.lineage = checkpoint_owner.claim(directory, cfg.job.job_name, resumed, checkpoint_owner.continues(
                directory, cfg.checkpoints.checkpoint_dir_for_init))
        return resumed

    def _open_ledger(self, tasks: TaskManager | None) -> bool:
        cfg = self.config
        self._ledger = store.ResilientStore(
            self._store,
            on_outage=lambda o: logger.warning("etcd was unreachable for %.1fs; the ledger is written again", o.seconds),
            on_fatal=lambda err: self._lost(str(err)),
        )
        snapshot = self._ledger.load_ledger()
        if self.in_etcd:
            logger.info("job state in etcd at %s under /elasticdl/%s/",
                        ",".join(cfg.elasticity.etcd_endpoints), cfg.job.job_name)
        if snapshot is None:
            return False
        if snapshot.job_fingerprint != self.fingerprint:
            raise JobFailedError(
                f"etcd holds a ledger for a different job named {cfg.job.job_name!r} (other data, task size, "
                "epochs or model). Use another --job_name."
            )
        tasks.restore(snapshot)
        self.resumed = True
        return True

    def _lost(self, why: str) -> None:
        self._lost_at = time.time()
        self.lost = why
        self._on_lost(why)

    def record_shard_roles(self, primary: list[int], backups: list[list[int]]) -> None:
        """--ps_replicas: every shard's primary and backups, in the store (docs/replicas.md)."""
        for shard, ps in enumerate(primary):
            self._store.put_shard_roles(shard, {**{b: "backup" for b in backups[shard]}, ps: "primary"}, self.term)

    def stored_shard_roles(self) -> dict[int, dict]:
        """--ps_replicas: the roles the job's masters recorded, {shard: {"term", "replicas"}}."""
        return self._store.shard_roles()

    def publish_master(self, address: str) -> None:
        if self._store is not None:
            self._store.publish_address("master", 0, address)

    def save(self, tasks: TaskManager) -> None:
        if self._ledger is not None:
            self._ledger.save(tasks.snapshot(self.fingerprint, saved_at=time.time()))

    def close(self, tasks: TaskManager | None, job_done: bool) -> None:
        """Release the lock; a finished job clears its ledger (a new run with this name starts fresh)."""
        if self._store is None:
            return
        if self.lost:  # nothing more may be written; waiting on an unreachable store helps nobody
            if self._ledger is not None:
                self._ledger.close(flush_timeout=0)
            self._store.abandon()
            logger.warning("left the leader lock and the master's address to expire in %s", self._store.describe())
            return
        try:
            if self._ledger is not None:
                if job_done:
                    self._ledger.close()
                    self._store.clear_ledger()
                else:
                    try:
                        self.save(tasks)
                    except store.StateStoreError:
                        pass  # the outcome of the job is already decided; keep what is stored
                    self._ledger.close()
            self._store.close()
        except Exception as err:  # never mask the job's own outcome
            logger.warning("closing the state store: %s", err)
