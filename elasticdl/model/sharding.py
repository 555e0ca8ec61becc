"""Where each dense variable lives: a stable hash of its name, the same in every process;
slice ``k`` of a sliced variable (elasticdl/model/slicing.py) on PS ``k``; where each
embedding row lives: ``id % num_ps``.

Python's built-in ``hash`` of a str is salted per process, so it cannot place variables.
"""

import zlib

import numpy as np

from elasticdl.model.slicing import parse_slice_name


def ps_for_variable(name: str, num_ps: int) -> int:
    """The index of the parameter server that holds variable (or slice) ``name``."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1. Received: {num_ps}")
    sliced = parse_slice_name(name)
    if sliced is not None:
        return sliced.index % num_ps
    return zlib.crc32(name.encode("utf-8")) % num_ps


def partition_by_ps(names, num_ps: int) -> list[list[str]]:
    """Variable names grouped by the PS that holds them (index = PS id)."""
    groups: list[list[str]] = [[] for _ in range(num_ps)]
    for name in names:
        groups[ps_for_variable(name, num_ps)].append(name)
    return groups


def partition_ids(ids: np.ndarray, num_ps: int) -> list[np.ndarray]:
    """For each PS, the positions in ``ids`` of the embedding ids it holds (``id % num_ps``)."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1. Received: {num_ps}")
    if num_ps == 1:
        return [np.arange(len(ids))]
    owner = np.asarray(ids) % num_ps
    return [np.flatnonzero(owner == ps) for ps in range(num_ps)]
