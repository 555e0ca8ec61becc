"""The mode matrix: what a seed runs (consistency mode, PS count, store, checkpoints)."""

from __future__ import annotations

import random
from dataclasses import dataclass

FAMILIES = ("sync", "sync-n", "async", "ssp", "push-steps", "overlap", "embedding")


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

    @property
    def name(self) -> str:
        return (f"{self.family}/ps{self.num_ps}/w{self.num_workers}/{self.store}"
                + ("" if self.checkpoints else "/no-ckpt"))

    @classmethod
    def pick(cls, rng: random.Random, family: str | None = None) -> Mode:
        family = family or rng.choice(FAMILIES)
        if family not in FAMILIES:
            raise ValueError(f"--mode must be one of {', '.join(FAMILIES)}. Received: {family!r}")
        base = dict(family=family, num_ps=rng.randint(1, 3), num_workers=rng.randint(1, 3),
                    store=rng.choice(("memory", "etcd")), checkpoints=rng.random() < 0.85)
        asynchronous = dict(use_async=True, get_model_steps=rng.choice((1, 1, 2)))
        extra = {
            "sync": dict(grads_to_wait=0),  # the default: one gradient per worker holding a task
            "sync-n": dict(grads_to_wait=rng.randint(2, 3), num_workers=rng.randint(2, 3)),
            "async": asynchronous,
            "ssp": {**asynchronous, "staleness_bound": rng.randint(1, 3)},
            "push-steps": {**asynchronous, "push_steps": rng.randint(2, 3)},
            "overlap": {**asynchronous, "overlap": True},
            "embedding": dict(embedding=True, **(asynchronous if rng.random() < 0.5 else {})),
        }[family]
        return cls(**{**base, **extra})
