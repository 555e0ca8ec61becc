"""The mode matrix: what a seed runs (consistency mode, PS count, store, checkpoints)."""

from __future__ import annotations

import random
from dataclasses import dataclass

FAMILIES = ("sync", "sync-n", "async", "ssp", "push-steps", "overlap", "embedding")
# Run with --mode only (a seed's default pick stays among FAMILIES, so that every seed quoted in
# the docs and tests replays as before): shard replicas, and a stream source.
EXTRA_FAMILIES = ("replicas", "stream")
ALL_FAMILIES = FAMILIES + EXTRA_FAMILIES


@dataclass(frozen=True)
class Mode:
    family: str
    num_ps: int = 1
    num_workers: int = 2
    store: str = "memory"  # "memory" or "etcd" (the etcd-like store: a master may restart)
    checkpoints: bool = True
    use_async: bool = False
    grads_to_wait: int = 1
    staleness_bound: int = 0
    push_steps: int = 1
    overlap: bool = False
    get_model_steps: int = 1
    embedding: bool = False
    ps_replicas: int = 0  # --ps_replicas: backups of each shard on the next PS
    stream: bool = False  # a stream source: offset ranges cut as records arrive, no epochs

    @property
    def name(self) -> str:
        return (f"{self.family}/ps{self.num_ps}/w{self.num_workers}/{self.store}"
                + (f"/r{self.ps_replicas}" if self.ps_replicas else "") + ("" if self.checkpoints else "/no-ckpt"))

    @classmethod
    def pick(cls, rng: random.Random, family: str | None = None) -> Mode:
        family = family or rng.choice(FAMILIES)
        if family not in ALL_FAMILIES:
            raise ValueError(f"--mode must be one of {', '.join(ALL_FAMILIES)}. Received: {family!r}")
        if family == "replicas":
            return cls._replicas(rng)
        if family == "stream":
            return cls._stream(rng)
        base = dict(family=family, num_ps=rng.randint(1, 3), num_workers=rng.randint(1, 3),
                    store=rng.choice(("memory", "etcd")), checkpoints=rng.random() < 0.85)
        asynchronous = dict(use_async=True, get_model_steps=rng.choice((1, 1, 2)))
        extra = {
            "sync": {},
            "sync-n": dict(grads_to_wait=rng.randint(2, 3), num_workers=rng.randint(2, 3)),
            "async": asynchronous,
            "ssp": {**asynchronous, "staleness_bound": rng.randint(1, 3)},
            "push-steps": {**asynchronous, "push_steps": rng.randint(2, 3)},
            "overlap": {**asynchronous, "overlap": True},
            "embedding": dict(embedding=True, **(asynchronous if rng.random() < 0.5 else {})),
        }[family]
        return cls(**{**base, **extra})

    @classmethod
    def _replicas(cls, rng: random.Random) -> Mode:
        """--ps_replicas 1 or 2 (below --num_ps) in sync, sync-n, async or SSP; no embedding
        table (a PS with replicas refuses them, docs/replicas.md)."""
        num_ps = rng.randint(2, 3)
        replicas = rng.choice((1, 2)) if num_ps == 3 else 1
        variant = rng.choice(("sync", "sync-n", "async", "ssp"))
        base = dict(family="replicas", num_ps=num_ps, num_workers=rng.randint(1, 3), ps_replicas=replicas,
                    store=rng.choice(("memory", "etcd")), checkpoints=rng.random() < 0.85)
        return cls(**{**base, **_consistency(rng, variant)})

    @classmethod
    def _stream(cls, rng: random.Random) -> Mode:
        """A stream source (Kafka-like partitions) in sync, sync-n, async, SSP or --push_steps."""
        variant = rng.choice(("sync", "sync-n", "async", "ssp", "push-steps"))
        base = dict(family="stream", stream=True, num_ps=rng.randint(1, 3), num_workers=rng.randint(1, 3),
                    store=rng.choice(("memory", "etcd")), checkpoints=rng.random() < 0.85)
        return cls(**{**base, **_consistency(rng, variant)})


def _consistency(rng: random.Random, variant: str) -> dict:
    """The consistency flags of a variant of the extra families (drawn only for that variant)."""
    if variant == "sync-n":
        return dict(grads_to_wait=rng.randint(2, 3), num_workers=rng.randint(2, 3))
    if variant == "sync":
        return {}
    flags: dict = dict(use_async=True)
    if variant == "async":
        flags["get_model_steps"] = rng.choice((1, 2))
    elif variant == "ssp":
        flags["staleness_bound"] = rng.randint(1, 3)
    elif variant == "push-steps":
        flags["push_steps"] = rng.randint(2, 3)
    return flags
