"""A PS writing its shard's checkpoints: when one is due, a consistent copy under the lock, the
write off the lock, pruning this lineage's old cuts, and what failed.

A part of ``ParameterServer`` (elasticdl/ps/server.py), in its own module.
"""

from __future__ import annotations

import logging

from elasticdl.model import checkpoint
from elasticdl.model.checkpoint_owner import lineage_floor

logger = logging.getLogger(__name__)


class ShardCheckpoints:
    """The checkpoint side of ``ParameterServer`` (its attributes are the server's)."""

    def checkpoint_health(self) -> tuple[int, str]:
        """(checkpoint writes that failed, the last failure's message), for the master."""
        with self._lock:
            return self.checkpoint_failures, self.checkpoint_error

    def _on_new_version(self) -> checkpoint.ShardState | None:
        """Called with the lock held whenever an update produced a version; a copy of the
        shard when a checkpoint is due, for the caller to write once it released the lock."""
        self._version_changed.notify_all()
        self.position.version_made()
        # Only a version an update produced is checkpointed: not the initial or restored model.
        return self._copy_locked() if self._checkpoint_due() else None

    def save_checkpoint(self) -> str:
        """Write this shard now (the end of training); '' without --checkpoint_dir.
        CheckpointWriteError when it cannot be written (also counted, as for a due one)."""
        with self._lock:
            if not self.settings.checkpoint_dir or not self.shard.initialized:
                return ""
            if self._last_checkpoint_version == self.shard.version:
                return self._path_for(self.shard.version)
            state = self._copy_locked()
        return self._write_checkpoint(state)

    def _checkpoint_due(self) -> bool:
        steps = self.settings.checkpoint_steps
        version = self.shard.version
        if self._cut_at is not None and version >= self._cut_at:
            missed, self._cut_at = version > self._cut_at, None
            if missed:  # a version makes one step: it cannot be passed over, but say so if it was
                logger.warning("the checkpoint asked at a version before %d was passed over", version)
            return bool(self.settings.checkpoint_dir) and version != self._last_checkpoint_version
        return bool(
            self.settings.checkpoint_dir
            and steps
            and version % steps == 0
            and version != self._last_checkpoint_version
        )

    def _path_for(self, version: int) -> str:
        return f"{self.settings.checkpoint_dir}/version-{version}"

    def _copy_locked(self) -> checkpoint.ShardState:
        """A copy of the shard (under the lock): updates go on while it is written."""
        tables = {}
        for name, table in self.shard.embeddings.items():
            ids, rows, slots, touched, meta = table.saved()  # copies
            tables[name] = checkpoint.TableState(table.info, ids, rows, slots, touched, meta)
        held = self.shard.non_trainable
        return checkpoint.ShardState(
            self.shard.version, self.shard.step,
            {n: v.copy() for n, v in self.shard.params.items() if n not in held},
            {n: {s: v.copy() for s, v in slots.items()} for n, slots in self.shard.slots.items()},
            tables,
            marks=dict(self.position.marks),
            records_applied=self.position.records_applied,
            term=self.term,
            non_trainable={n: self.shard.params[n].copy() for n in held},
        )

    def _write_due_checkpoint(self, state: checkpoint.ShardState | None) -> None:
        """Write a checkpoint an update made due. A failure is logged and counted (the master
        reports it), never raised: the update was applied, and the next checkpoint retries."""
        if state is None:
            return
        try:
            self._write_checkpoint(state)
        except Exception:  # noqa: BLE001  logged and counted by _write_checkpoint
            pass

    def _write_checkpoint(self, state: checkpoint.ShardState) -> str:
        """Write ``state`` (off the PS lock), then prune; one write at a time."""
        path = self._path_for(state.version)
        with self._checkpoint_lock:
            if state.version <= self._last_checkpoint_version:
                return path  # written meanwhile (or a newer one: an older one would be pruned)
            try:
                checkpoint.save_shard(self.settings.checkpoint_dir, self.settings.ps_id, self.settings.num_ps, state)
            except Exception as err:
                expected = isinstance(err, checkpoint.CheckpointWriteError)  # else a bug: with its traceback
                message = str(err) if expected else (
                    f"could not write checkpoint version {state.version}: {type(err).__name__}: {err}")
                with self._lock:
                    self.checkpoint_failures += 1
                    self.checkpoint_error = message
                logger.error("%s; training goes on and the next checkpoint tries again", message, exc_info=not expected)
                raise
            directory = self.settings.checkpoint_dir  # only this lineage's cuts (model/checkpoint_owner.py)
            checkpoint.prune(directory, self.settings.keep_checkpoint_max, lineage_floor(directory, self.term))
            self._last_checkpoint_version = state.version
        logger.info("checkpoint at version %d", state.version)
        return path
