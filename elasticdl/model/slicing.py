"""Large dense variables sliced by rows across the parameter servers (--slice_dense_above_mb).

A dense variable larger than the threshold, with at least as many rows as there are PS, is cut
along axis 0 into one slice per PS: slice ``k`` of ``n`` holds rows ``row_range(rows, k, n)``
and lives on PS ``k`` (elasticdl/model/sharding.py). On the PS a slice is an ordinary dense
variable named ``<name>#slice-<k>-of-<n>``, with its own optimizer slots: pulls, pushes,
snapshots, checkpoints and replicas carry it as they carry any variable. The optimizers the PS
applies (SGD, momentum, Adam, Adagrad...) are elementwise, so updating the slices is updating
the whole variable, bit for bit.

Workers cut each gradient (and the model they push first) with ``DenseSlicing.pieces`` and
write the pulled slices into their rows of the whole variable (``with_slices_joined``). A
checkpoint holds each PS's slices; restoring on another number of PS (or with another
threshold) joins them and cuts them again (elasticdl/model/slice_restore.py). ``#`` never
appears in a TensorFlow or Keras variable name, so a slice's name cannot clash with a
variable's. ``clipnorm`` clips by a whole variable's norm, which no PS holding a slice sees:
it is refused at submit (``clipnorm_problem``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from elasticdl.model.non_trainable import NonTrainableChange

MB = 1 << 20
# 32 MiB: a 2,900 x 2,900 float32 kernel. Smaller variables (every one of the model zoo's and
# the benchmarks' models) stay whole, placed by name hash, as before slicing existed.
DEFAULT_SLICE_ABOVE_MB = 32.0
_SLICE_NAME = re.compile(r"^(?P<whole>.+)#slice-(?P<index>\d+)-of-(?P<count>\d+)$")


class SliceError(ValueError):
    """Slices that do not make one whole variable (a damaged or mixed checkpoint, a wrong push)."""


@dataclass(frozen=True)
class SliceName:
    whole: str
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.whole}#slice-{self.index}-of-{self.count}"


def parse_slice_name(name: str) -> SliceName | None:
    """The parts of a slice's name; None for a whole variable's name (or a name that only looks
    like a slice's: slice 3 of 2 names no slice, and no variable either, so it stays unknown)."""
    match = _SLICE_NAME.match(name)
    if match is None or not 0 <= int(match["index"]) < int(match["count"]):
        return None
    return SliceName(match["whole"], int(match["index"]), int(match["count"]))


def whole_name(name: str) -> str:
    """The variable a (slice's or whole variable's) name belongs to."""
    parsed = parse_slice_name(name)
    return name if parsed is None else parsed.whole


def row_range(rows: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, end) of slice ``index`` of ``count``: the first ``rows % count`` slices hold
    one row more (numpy's array_split)."""
    base, extra = divmod(rows, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def threshold_bytes(above_mb: float) -> int | None:
    """--slice_dense_above_mb in bytes; None (never slice) when negative."""
    return None if above_mb < 0 else int(above_mb * MB)


@dataclass(frozen=True)
class DenseSlicing:
    """Which variables are sliced, and into how many slices (the number of PS).

    ``above_bytes``: a variable of more bytes is sliced (None: none is; 0: every one with
    enough rows). Every role of a job computes the same from the same flag.
    """

    above_bytes: int | None
    num_ps: int

    @classmethod
    def from_flag(cls, above_mb: float, num_ps: int) -> DenseSlicing:
        return cls(threshold_bytes(above_mb), num_ps)

    def count(self, shape: tuple[int, ...], nbytes: int) -> int:
        """The number of slices of a variable of ``shape`` and ``nbytes`` (1: it stays whole)."""
        if self.above_bytes is None or self.num_ps < 2 or nbytes <= self.above_bytes:
            return 1
        if len(shape) == 0 or shape[0] < self.num_ps:
            return 1  # fewer rows than PS: some would hold nothing
        return self.num_ps

    def pieces(self, name: str, value) -> Iterator[tuple[str, object]]:
        """(name, value) of each piece of ``value`` to send: the value itself, or its slices
        (row views, no copy). A NonTrainableChange (``.values``) is cut as its variable is."""
        change = isinstance(value, NonTrainableChange)
        array = np.asarray(value.values if change else value)
        count = self.count(array.shape, array.nbytes)
        if count == 1 or parse_slice_name(name) is not None:
            yield name, value
            return
        for index in range(count):
            start, end = row_range(array.shape[0], index, count)
            piece = array[start:end]
            yield str(SliceName(name, index, count)), (NonTrainableChange(piece) if change else piece)

    def split(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` with every variable to slice replaced by its slices."""
        return {piece_name: piece for name, value in arrays.items() for piece_name, piece in self.pieces(name, value)}


def clipnorm_problem(slicing: DenseSlicing, optimizer_config: dict, trainable: dict) -> str:
    """Why the optimizer cannot update the ``trainable`` variables ``slicing`` cuts ('' when it
    can): ``clipnorm`` clips each variable by its own norm, and a PS sees only its slice's rows.
    ``trainable``: arrays or tf.Variables by name (only their shapes and dtypes are read).
    Checked at submit (master/preflight.py)."""
    clipnorm = optimizer_config.get("clipnorm")
    if not (clipnorm and clipnorm > 0):  # Keras's own test: clipnorm set and above 0
        return ""
    sizes = {name: (tuple(value.shape), _nbytes(value)) for name, value in trainable.items()}
    sliced = {name: nbytes for name, (shape, nbytes) in sizes.items() if slicing.count(shape, nbytes) > 1}
    if not sliced:
        return ""
    largest = math.ceil(max(sliced.values()) * 100 / MB) / 100  # rounded up: at it, none is above
    names = ", ".join(sorted(sliced)[:3]) + (", ..." if len(sliced) > 3 else "")
    return (
        f"--slice_dense_above_mb cuts {len(sliced)} variables ({names}) into one slice per parameter "
        f"server, and the optimizer's clipnorm={clipnorm} clips each variable by its own norm: a slice would "
        f"be clipped by the norm of its rows only. Raise --slice_dense_above_mb to {largest:.2f} or more "
        "(or -1: slice none), or clip by value (clipvalue) instead"
    )


def _nbytes(value) -> int:
    dtype = getattr(value.dtype, "as_numpy_dtype", value.dtype)  # a tf.DType, or a numpy one
    return int(np.prod(value.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def sliced_names(names, parts: list[dict]) -> list[str]:
    """The names in ``parts`` (a split model) of the variables ``names`` and of their slices."""
    wanted = set(names)
    return sorted(n for part in parts for n in part if whole_name(n) in wanted)


def held_variables(names) -> set[str]:
    """The variables whose values (whole, or as slices) ``names`` carry."""
    return {whole_name(n) for n in names}


def with_slices_joined(params: dict, variable_of) -> dict:
    """``params`` with the slices of each variable written into its rows: ``{name: whole
    value}``. ``variable_of(name)``: the model's tf.Variable (None: unknown, left for the caller
    to name). All of a variable's slices (a merged pull) are joined; some of them are written
    into a copy of the variable. A pulled slice is written whole, never with a strided assign:
    TensorFlow's took 2-15x a whole variable's assign. SliceError when a slice does not fit."""
    out, slices = {}, {}
    for name, value in params.items():
        parsed = parse_slice_name(name)
        if parsed is None or variable_of(parsed.whole) is None:
            out[name] = value
        else:
            slices.setdefault(parsed.whole, {})[parsed.index] = (parsed.count, value, name)
    for whole, parts in slices.items():
        variable = variable_of(whole)
        shape = tuple(variable.shape)
        for index, (count, value, name) in parts.items():
            start, end = row_range(shape[0], index, count) if shape else (0, 0)
            if not shape or tuple(np.shape(value)) != (end - start, *shape[1:]):
                raise SliceError(
                    f"the parameter server holds {name!r} with shape {tuple(np.shape(value))}, which is not rows "
                    f"{start}:{end} of this model's variable of shape {shape}: was the checkpoint made by a "
                    "different model?"
                )
        counts = {count for count, _, _ in parts.values()}
        if len(counts) == 1 and len(parts) == next(iter(counts)):
            out[whole] = join(whole, {index: (count, value) for index, (count, value, _) in parts.items()})
            continue
        current = np.array(variable.numpy())
        for index, (count, value, _) in parts.items():
            start, end = row_range(shape[0], index, count)
            current[start:end] = value
        out[whole] = current
    return out


def join(name: str, slices: dict[int, tuple[int, np.ndarray]]) -> np.ndarray:
    """The whole variable ``name`` from its slices {index: (count, rows)}; SliceError when one
    is missing or they were cut in different ways."""
    counts = {count for count, _ in slices.values()}
    if len(counts) != 1:
        raise SliceError(f"variable {name!r} is held as slices of different cuts ({sorted(counts)} slices)")
    (count,) = counts
    missing = sorted(set(range(count)) - set(slices))
    if missing:
        raise SliceError(f"variable {name!r}: slices {missing} of {count} are missing")
    if count == 1:
        return slices[0][1]
    return np.concatenate([slices[index][1] for index in range(count)])
