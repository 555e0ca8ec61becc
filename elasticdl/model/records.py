"""Which records of a failed batch are to blame: bad data, told apart from a bad model.

A batch can fail because of one record: ``dataset_fn`` cannot parse it (a missing feature, a
CSV line with the wrong number of columns), or the model or the loss rejects one of its
values (a label out of range, an id past an embedding's vocabulary). ``find_bad_records``
finds such records by bisection: a group of records is checked in one pipeline, a failing
group is split in two, and a single record that fails on its own is bad. k bad records among
n cost about 2k·log2(n) checks of a few ms each. When no single record fails on its own the
failure is not the data's, and the caller raises the original error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from elasticdl.errors import ElasticDLError
from elasticdl.mode import Mode
from elasticdl.model.spec import DatasetMetadata, ModelSpec, ModelSpecError

# TensorFlow's decorations around an op's own message.
_FUNCTION_NODE = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_USER_FUNCTION = re.compile(r"Error in user-defined function passed to \S+ transformation with iterator: \S+: ")
_REASON_CHARS = 300


def describe_error(err: BaseException) -> str:
    """One line for a record's failure: ``InvalidArgumentError: Feature: label ... not be found.``"""
    text = getattr(err, "message", None) or str(err)
    text = text.split("\n\t [[", 1)[0]  # the node that raised it
    text = text.strip().split("\n\n")[-1]  # "Graph execution error: ... <traceback> ... <the message>"
    text = _FUNCTION_NODE.sub("", text)
    text = _USER_FUNCTION.sub("", text)
    text = re.sub(r"\s*\[Op:[^\]]*\](\s*name:\s*\S*)?\s*$", "", text)
    text = " ".join(text.split())
    if len(text) > _REASON_CHARS:
        text = text[: _REASON_CHARS - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def find_bad_records(
    records: Sequence[bytes],
    check: Callable[[Sequence[bytes]], Any],
    passthrough: tuple[type[BaseException], ...] = (ElasticDLError,),
) -> list[tuple[int, str]]:
    """(position in ``records``, reason) of each record on which ``check`` fails on its own.

    ``check(records)`` raises if the group fails. An error of a ``passthrough`` type (a
    parameter server that does not answer, a model zoo that breaks the contract) is not the
    records' fault: it ends the search and is raised.
    """
    bad: list[tuple[int, str]] = []

    def visit(lo: int, hi: int) -> None:
        try:
            check(records[lo:hi])
            return
        except passthrough:
            raise
        except Exception as err:
            if hi - lo == 1:
                bad.append((lo, describe_error(err)))
                return
        mid = (lo + hi) // 2
        visit(lo, mid)
        visit(mid, hi)

    if records:
        visit(0, len(records))
    return bad


def example_check(
    spec: ModelSpec, mode: Mode, metadata: DatasetMetadata, run_model: Callable[[Any], Any]
) -> Callable[[Sequence[bytes]], None]:
    """A ``check`` for ``find_bad_records``: the records through ``dataset_fn``, the model
    (``run_model(features) -> predictions``) and, when training, the loss."""
    from elasticdl.model.sample_weight import features_of, unpack, weighted_loss
    from elasticdl.model.trainer import make_dataset

    def check(records: Sequence[bytes]) -> None:
        try:
            dataset = make_dataset(spec, records, mode, metadata, len(records))
        except ModelSpecError:
            raise
        except Exception as err:  # dataset_fn fails before it sees a record: no record is to blame
            raise ModelSpecError(
                f"{spec.module_path}: dataset_fn(dataset, {mode}, metadata) failed: {describe_error(err)}"
            ) from err
        for element in dataset:
            if mode == Mode.PREDICTION:
                run_model(features_of(element))
                continue
            features, labels, sample_weight = unpack(element, spec, mode)
            predictions = run_model(features)
            if mode == Mode.TRAINING:
                weighted_loss(spec.loss, labels, predictions, sample_weight, spec.module_path)

    return check
