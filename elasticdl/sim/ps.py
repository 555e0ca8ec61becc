"""A simulated parameter server: the real ParameterServer core behind the simulated network.

It serves what the workers call (pull, push, push_model, table infos) and what the master
calls directly (live workers, fence, roll back, checkpoint, stats). Each call updates the
oracle (sim/oracle.py) from what the real core did: accepted pushes, versions made,
checkpoints written, restores.
"""

from __future__ import annotations

import numpy as np

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.rpc.ps_client import PushAnswer
from elasticdl.sim.model import EMBEDDING, LEARNING_RATE
from elasticdl.sim.modes import Mode
from elasticdl.sim.oracle import Oracle
from elasticdl.sim.transport import Unavailable

CHECKPOINT_STEPS = 4


def settings_for(mode: Mode, ps_id: int, checkpoint_dir: str, term: int, restore_from: str = "",
                 fence_floor: int = 0) -> PSSettings:
    return PSSettings(
        ps_id=ps_id, num_ps=mode.num_ps, grads_to_wait=mode.grads_to_wait, use_async=mode.use_async,
        checkpoint_dir=checkpoint_dir, checkpoint_steps=CHECKPOINT_STEPS if checkpoint_dir else 0,
        keep_checkpoint_max=3, checkpoint_dir_for_init=restore_from, term=term, fence_floor=fence_floor,
        restore_position=bool(restore_from),
    )


class SimPS:
    """One PS process (an incarnation: a relaunch makes a new one)."""

    def __init__(self, ps_id: int, settings: PSSettings, oracle: Oracle) -> None:
        self.ps_id = ps_id
        self.oracle = oracle
        self.alive = False  # serving: set once started
        self.frozen = False
        self.core = ParameterServer(settings, make_optimizer(OptimizerSpec("SGD", {"learning_rate": LEARNING_RATE})))

    def start(self) -> None:
        """Load the checkpoint it was started with (raises CheckpointError when it cannot)."""
        self.core.restore()
        if self.core.settings.checkpoint_dir_for_init:
            self.oracle.restored(self.ps_id, self.core.shard.version)
        self.alive = True

    # ------------------------------------------------------------ the oracle

    def _observe(self, call):
        """Run ``call`` on the core and note what it did: versions made and checkpoints written."""
        before = (self.core.shard.version, self.core._last_checkpoint_version)
        result = call()
        if self.core.shard.version != before[0]:
            self.oracle.version_made(self.ps_id)
        if self.core._last_checkpoint_version != before[1] and self.core.shard.version == self.core._last_checkpoint_version:
            self.oracle.checkpointed(self.ps_id, self.core._last_checkpoint_version)
        self.oracle.check_counts(self.ps_id, self.core.position.records_applied)
        return result

    def _serving(self) -> None:
        if not self.alive or self.frozen:
            raise Unavailable(f"ps-{self.ps_id} is not serving")

    # ------------------------------------------------------------ worker calls (network)

    def rpc_pull(self, version: int, ids: list[int]):
        initialized, now, params = self.core.pull(version)
        rows = {}
        mine = np.array([i for i in ids if i % self.core.settings.num_ps == self.ps_id], np.int64)
        if initialized and mine.size and EMBEDDING in self.core.shard.embeddings:
            looked_up = self.core.lookup_embeddings(EMBEDDING, mine, create=True)
            rows = {int(i): np.array(r, np.float32) for i, r in zip(mine, looked_up)}
        return initialized, now, {n: np.array(v) for n, v in params.items()}, rows

    def rpc_push(self, grads: dict, version: int, want_params: bool, batch, keys: tuple) -> PushAnswer:
        def push():
            result = self.core.push_gradients(grads, version, None, batch=batch)
            if result.accepted and result.reason != "already applied":
                self.oracle.accepted(self.ps_id, keys)
            return result

        result = self._observe(push)
        params = None
        if want_params and result.applied:
            params = {n: np.array(v) for n, v in self.core.shard.params.items()}
        return PushAnswer(result.outcome, result.version, result.reason, params)

    def rpc_pull_snapshot(self, snapshot_id: int, ids: list[int]):
        """(version, params, rows) of an evaluation snapshot; None when this PS holds none (NOT_FOUND)."""
        try:
            _, version, params = self.core.pull_snapshot(snapshot_id)
            mine = np.array([i for i in ids if i % self.core.settings.num_ps == self.ps_id], np.int64)
            rows = {}
            if mine.size and EMBEDDING in self.core.shard.embeddings:
                looked_up = self.core.lookup_embeddings(EMBEDDING, mine, create=False, snapshot_id=snapshot_id)
                rows = {int(i): np.array(r, np.float32) for i, r in zip(mine, looked_up)}
        except KeyError:
            return None
        return version, {n: np.array(v) for n, v in params.items()}, rows

    def rpc_push_model(self, params: dict, version: int = 0) -> bool:
        return self.core.push_model(params, version)[0]

    def rpc_push_table_infos(self, infos) -> None:
        self.core.push_embedding_table_infos(infos)

    # ------------------------------------------------------------ master calls (direct)

    def set_live_workers(self, count: int) -> None:
        self._serving()
        self._observe(lambda: self.core.set_live_workers(count))

    def level_version(self, version: int, term: int) -> int:
        self._serving()
        return self.core.level_version(version, term)

    def fence(self, handouts: list[int], task_ids: list[int], term: int) -> dict[int, int]:
        self._serving()
        return self.core.fence(handouts, task_ids, term)

    def roll_back(self, path: str, term: int, fence_floor: int) -> int:
        self._serving()
        version = self.core.roll_back(path, term, fence_floor)
        self.oracle.restored(self.ps_id, version)
        return version

    def checkpoint_at(self, version: int, term: int) -> str:
        self._serving()
        return self._observe(lambda: self.core.checkpoint_at(version, term))

    def save_checkpoint(self) -> str:
        self._serving()
        return self._observe(self.core.save_checkpoint)

    def take_snapshot(self, round_id: int) -> int:
        self._serving()
        return self.core.take_snapshot(round_id)

    def drop_snapshot(self, round_id: int) -> None:
        self._serving()
        self.core.drop_snapshot(round_id)

    def version(self) -> int:
        self._serving()
        return self.core.shard.version

    def stats(self):
        self._serving()
        return self.core.stats()

