"""What the simulator's test files share: a world run to its end, the real code's logs off."""

from __future__ import annotations

import logging

import pytest

from elasticdl.sim.world import World


@pytest.fixture
def quiet():
    logging.disable(logging.CRITICAL)  # the real code logs every fault it rides out
    yield
    logging.disable(logging.NOTSET)


def run(seed: int, family: str, faults: bool = True) -> World:
    """Seed ``seed`` of mode family ``family``, run to its end (``world.result`` holds the run)."""
    world = World(seed, family, faults=faults)
    world.run()
    return world


def clean_runs_without_faults(family: str, seeds: int = 5) -> list[World]:
    """Seeds 0..seeds-1 of ``family`` without faults, each asserted to end with no violation."""
    worlds = []
    for seed in range(seeds):
        world = run(seed, family, faults=False)
        assert world.result.violations == [] and world.result.outcome == "finished", (seed, world.result.violations)
        worlds.append(world)
    return worlds
