"""A sync PS moving its version up to the other shards' once training is over (``level_version``).

A part of ``ParameterServer`` (elasticdl/ps/server.py), in its own module: the master's
``LevelVersions`` (elasticdl/master/leveling.py, docs/consistency.md "One version at the end").
"""

from __future__ import annotations

import logging

from elasticdl.ps.strategies import VERSION_AHEAD_MARGIN

logger = logging.getLogger(__name__)


class ShardLeveling:
    """The leveling side of ``ParameterServer`` (its attributes are the server's)."""

    def level_version(self, version: int, term: int) -> int:
        """Sync, once training is over: move this shard's version up to ``version`` (the highest
        of the job's shards), its parameters unchanged. Shards group the same gradients into
        versions differently after faults (docs/consistency.md, "One version at the end"): the
        master levels them so that the job ends, and is cut, at one version. A shard at
        ``version`` or past it (or an async one) stays as it is. Returns the version after.
        StaleTermError from a master of an older term; ValueError when this PS holds no model
        (relaunched empty: a waiting worker refills it, then the master asks again) or gradients
        still wait in the average (the master tells 0 live workers first, which applies them)."""
        self.check_term(term)
        with self._lock:
            if self.settings.use_async:
                return self.shard.version
            if not self.shard.initialized and version > 0:  # 0: no shard holds a trained model (lost)
                raise ValueError(f"cannot level to version {version}: this PS holds no model yet (a worker "
                                 "refills it)")
            if version <= self.shard.version:
                return self.shard.version
            if version > self.shard.version + VERSION_AHEAD_MARGIN:  # shards differ by a few versions
                raise ValueError(f"cannot level to version {version}: more than {VERSION_AHEAD_MARGIN} versions "
                                 f"ahead of this PS's {self.shard.version}")
            if self.strategy.pending:
                raise ValueError(
                    f"cannot level to version {version}: {self.strategy.pending} gradients wait in the "
                    "average (tell the PS 0 live workers first)"
                )
            logger.info("version %d leveled to %d, the other shards' (the parameters are unchanged)",
                        self.shard.version, version)
            self.shard.version = version
            self._version_changed.notify_all()
            entry = self._replicate_locked("level", version, term)
        self._deliver(entry)
        return version
