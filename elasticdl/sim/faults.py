"""The nemesis: a seeded schedule of faults, all within the first seconds of a job.

Kill, restart (a killed role is relaunched by the master), freeze and thaw any role; lose,
duplicate and delay messages; cut the state store; corrupt or truncate the newest checkpoint.
After ``end`` no fault happens, so the job must make progress and end.
"""

from __future__ import annotations

from elasticdl import fs
from elasticdl.model import checkpoint

KINDS = ("kill-worker", "kill-ps", "freeze-worker", "freeze-ps", "kill-master", "freeze-master", "cut-store",
         "damage-checkpoint", "network", "partition-master")
MAX_PS_KILLS = 2  # the controller relaunches a PS at most 3 times (MAX_PS_RELAUNCHES)


class Nemesis:
    def __init__(self, world, enabled: bool = True) -> None:
        self.world = world
        self.enabled = enabled
        self.end = 0.0
        self.ps_kills = 0
        self.ps_freezes = 0
        self.kinds = KINDS
        if world.mode.ps_replicas:
            # PS deaths more often (a primary, a backup, or a shard's both replicas), and the
            # network's faults: forwards lost, retried, duplicated and reordered.
            self.kinds = KINDS + ("kill-ps",) * 3 + ("kill-ps-pair",) + ("network",) * 3
        if world.mode.stream:  # the broker away: the source waits it out, its time is not idle time
            self.kinds = KINDS + ("cut-broker",) * 2
        self._frozen_until: dict[int, float] = {}  # id of a frozen role -> when its last freeze ends

    def _freeze_for(self, role, seconds: float, thaw) -> None:
        """Overlapping freezes of one role end with the last of them (SIGSTOP twice, SIGCONT once)."""
        until = max(self._frozen_until.get(id(role), 0.0), self.world.clock() + seconds)
        self._frozen_until[id(role)] = until

        def maybe_thaw() -> None:
            if self.world.clock() >= self._frozen_until.get(id(role), 0.0):
                self._frozen_until.pop(id(role), None)
                thaw()

        self.world.scheduler.at(seconds, maybe_thaw)

    def schedule(self) -> None:
        if not self.enabled:
            return
        rng = self.world.rng
        count = rng.randint(0, 5)
        times = sorted(rng.uniform(0.05, 2.5) for _ in range(count))
        for when in times:
            kind = rng.choice(self.kinds)
            self.world.scheduler.at(when, lambda k=kind: self._inject(k))
        self.end = times[-1] + 3.0 if times else 0.0

    def _note(self, what: str) -> None:
        self.world.result.faults.append(f"t={self.world.clock():.3f}s {what}")

    def _inject_at(self, delay: float, kind: str, target: int) -> None:
        self.world.scheduler.at(delay, lambda: self._inject(kind, target))

    def _inject(self, kind: str, target: int | None = None) -> None:
        world, rng = self.world, self.world.rng
        if world.outcome is not None:
            return
        mode = world.mode
        if kind == "kill-worker" and world.workers:
            index = rng.choice(sorted(world.workers))
            world.kill_worker(index)
            self._note(f"kill worker {index}")
        elif kind == "kill-ps" and self.ps_kills < MAX_PS_KILLS:
            ps_id = rng.randrange(mode.num_ps) if target is None else target
            if world.ps[ps_id].alive:
                self.ps_kills += 1
                world.kill_ps(ps_id)
                self._note(f"kill ps {ps_id}")
        elif kind == "kill-ps-pair" and self.ps_kills == 0:
            # A shard's primary and, a moment later, its backup (the next PS): every replica lost.
            ps_id = rng.randrange(mode.num_ps)
            self._inject_at(0.0, "kill-ps", ps_id)
            self._inject_at(rng.uniform(0.0, 0.5), "kill-ps", (ps_id + 1) % mode.num_ps)
        elif kind == "cut-broker" and world.topic is not None:
            seconds = rng.uniform(0.2, 3.0)
            world.topic.available = False
            world.scheduler.at(seconds, self._restore_broker)
            self._note(f"cut the broker off for {seconds:.2f}s")
        elif kind == "freeze-worker" and world.workers:
            index = rng.choice(sorted(world.workers))
            process = world.workers[index][1]
            # Now and then past the task timeout: a gray failure the master must replace.
            seconds = rng.uniform(0.1, 2.0) if rng.random() < 0.8 else rng.uniform(20.0, 40.0)
            process.freeze()
            self._freeze_for(process, seconds, process.thaw)
            self._note(f"freeze worker {index} for {seconds:.2f}s")
        elif kind == "freeze-ps":
            ps_id = rng.randrange(mode.num_ps)
            ps = world.ps[ps_id]
            seconds = rng.uniform(0.1, 2.0)
            ps.frozen = True
            self.ps_freezes += 1
            self._freeze_for(ps, seconds, lambda: self._thaw_ps(ps))
            self._note(f"freeze ps {ps_id} for {seconds:.2f}s")
        elif kind == "kill-master" and mode.store == "etcd" and world.master.alive:
            world.kill_master()
            self._note("kill the master (a new one resumes from the store)")
        elif kind == "freeze-master":
            master, process = world.master, world.master_process
            seconds = rng.uniform(0.1, 1.5)
            master.frozen = True
            process.freeze()
            self._freeze_for(master, seconds, lambda: self._thaw_master(master, process))
            self._note(f"freeze the master for {seconds:.2f}s")
        elif kind == "cut-store" and mode.store == "etcd":
            # Now and then past the renew deadline: the master must stop acting, another resumes.
            seconds = rng.uniform(0.1, 2.0) if rng.random() < 0.8 else rng.uniform(7.0, 12.0)
            world.store_backend.available, world.store_cut = False, True
            world.scheduler.at(seconds, self._restore_store)
            self._note(f"cut the state store for {seconds:.2f}s")
        elif kind == "partition-master" and mode.store == "etcd" and world.master.alive:
            # The master's node is cut off (frozen here) and a supervisor starts a replacement,
            # which leads once the old lease expired; the old one must not act when it is back.
            master, process = world.master, world.master_process
            seconds = rng.uniform(12.0, 25.0)
            master.frozen = True
            process.freeze()
            self._freeze_for(master, seconds, lambda: self._thaw_master(master, process))
            world.start_master()
            self._note(f"partition the master for {seconds:.2f}s; a new one starts")
        elif kind == "damage-checkpoint" and world.checkpoint_dir:
            truncate = rng.random() < 0.5
            path = damage(world.checkpoint_dir, rng, truncate)
            if path:
                self._note(f"{'truncate' if truncate else 'corrupt'} {path.rsplit('/', 2)[-2]}")
        elif kind == "network":
            faults = world.network.faults
            faults.drop, faults.duplicate = rng.choice((0.0, 0.02, 0.1)), rng.choice((0.0, 0.05, 0.2))
            faults.max_delay = rng.choice((0.002, 0.02, 0.2))
            seconds = rng.uniform(0.2, 2.0)
            world.scheduler.at(seconds, self._calm_network)
            self._note(f"network drop={faults.drop} duplicate={faults.duplicate} delay<={faults.max_delay}s "
                       f"for {seconds:.2f}s")

    def _thaw_ps(self, ps) -> None:
        ps.frozen = False
        if self.world.ps[ps.ps_id] is ps:
            self.world.network.thawed(f"ps-{ps.ps_id}")

    def _thaw_master(self, master, process) -> None:
        master.frozen = False
        # Which runs first after SIGCONT, the job's loop or a request waiting for it, is a race.
        if self.world.rng.random() < 0.5:
            process.thaw()
            self.world.network.thawed("master")
        else:
            self.world.network.thawed("master")
            process.thaw()

    def _restore_broker(self) -> None:
        self.world.topic.available = True

    def _restore_store(self) -> None:
        self.world.store_backend.available, self.world.store_cut = True, False

    def _calm_network(self) -> None:
        faults = self.world.network.faults
        faults.drop, faults.duplicate, faults.max_delay = 0.0, 0.0, 0.002


def damage(checkpoint_dir: str, rng, truncate: bool) -> str:
    """Corrupt or truncate one shard file of the newest complete cut; the file's path ('' if none)."""
    versions = checkpoint.complete_versions(checkpoint_dir)
    if not versions:
        return ""
    files = sorted(fs.glob(fs.join(checkpoint_dir, f"version-{versions[-1]}", "ps-*-of-*.npz")))
    if not files:
        return ""
    path = rng.choice(files)
    data = fs.read_bytes(path)
    damaged = data[: len(data) // 2] if truncate else data[:64] + bytes(b ^ 0x5A for b in data[64:128]) + data[128:]
    with fs.open(path, "wb") as f:
        f.write(damaged)
    return path
