"""A checkpoint's dense variables placed for this PS: whole ones by name hash, sliced ones
(elasticdl/model/slicing.py) joined and cut again for the number of PS and the threshold of
the job that restores them."""

from __future__ import annotations

import numpy as np

from elasticdl.model.sharding import ps_for_variable
from elasticdl.model.slicing import DenseSlicing, SliceName, join, parse_slice_name, row_range


class DenseRestore:
    """The dense arrays of a checkpoint cut, placed for PS ``ps_id`` of ``num_ps`` as
    ``slicing`` cuts them now: slices of an older cut are joined and cut again.

    ``add`` every array of every shard file (its group: "param", "non_trainable" or
    "slot:<slot>"); ``placed`` then gives this PS's arrays per group. Whole arrays of another
    PS that stay whole are dropped at once; the slices of a variable are kept until joined.
    """

    def __init__(self, ps_id: int, num_ps: int, slicing: DenseSlicing):
        self.ps_id, self.num_ps, self.slicing = ps_id, num_ps, slicing
        self._parts: dict[tuple[str, str], dict[int, tuple[int, np.ndarray]]] = {}

    def add(self, group: str, name: str, value: np.ndarray) -> None:
        parsed = parse_slice_name(name)
        if parsed is not None:
            self._parts.setdefault((group, parsed.whole), {})[parsed.index] = (parsed.count, value)
        elif ps_for_variable(name, self.num_ps) == self.ps_id or self.slicing.count(value.shape, value.nbytes) > 1:
            self._parts[(group, name)] = {0: (1, value)}

    def placed(self) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {}
        for (group, name), slices in self._parts.items():
            whole = join(name, slices)
            count = self.slicing.count(whole.shape, whole.nbytes)
            if count == 1:
                if ps_for_variable(name, self.num_ps) == self.ps_id:
                    out.setdefault(group, {})[name] = whole
            elif self.ps_id < count:
                start, end = row_range(whole.shape[0], self.ps_id, count)
                out.setdefault(group, {})[str(SliceName(name, self.ps_id, count))] = np.array(whole[start:end])
        return out
