""""Did you mean": the nearest known name to one that is not known (a flag, a model-zoo function).

A Keras user types Keras's names (``--batch_size``, ``--epochs``): those that have a flag here
map to it by ``KERAS_NAMES``, whose every target is a real flag (tests/test_flag_suggestions.py
checks it). Those that have none say where the setting goes instead (``KERAS_ELSEWHERE``,
as docs/model_zoo.md's "From model.fit" table does). Any other name gets its nearest known
name by ``difflib``, if one is close enough. Used by the command line
(elasticdl/cli/argparser.py), by ``JobConfig.from_flags`` (the Python API) and by the
model-zoo check (a missing function).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# Keras's compile()/fit()/evaluate()/predict() argument -> the flag that does its job here.
KERAS_NAMES = {
    "batch_size": "minibatch_size",
    "validation_batch_size": "minibatch_size",
    "epochs": "num_epochs",
}
# Keras's names that no flag stands for -> where the setting goes (docs/model_zoo.md#from-modelfit).
KERAS_ELSEWHERE = {
    "steps_per_epoch": "an epoch is one pass over --training_data; stop early with a callback (EarlyStopping)",
    "validation_steps": "evaluation reads the whole --validation_data",
    "validation_split": "pass the held-out records as --validation_data",
    "validation_freq": "evaluation runs at every epoch's end, and every --evaluation_steps model versions",
    "initial_epoch": "--checkpoint_dir_for_init continues from a checkpoint's model (the data starts again "
                     "at epoch 1: pass the epochs left as --num_epochs)",
    "learning_rate": "the model zoo's optimizer() sets it (a LearningRateScheduler callback changes it)",
    "lr": "the model zoo's optimizer() sets it (a LearningRateScheduler callback changes it)",
    "metrics": "the model zoo's eval_metrics_fn() returns them (--eval_metrics_fn names another function)",
    "shuffle": "tasks are shuffled every epoch (--shuffle_seed picks the order)",
    "verbose": "the progress line shows on a terminal; --log_level sets how much is logged",
}
# How close a name must be to count as a typo of a known one (difflib's ratio).
CUTOFF = 0.6


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name``, if one is close enough (else None)."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=CUTOFF)
    return matches[0] if matches else None


def flag_hint(name: str, known: Iterable[str], prefix: str = "--") -> str:
    """A sentence that helps the user of unknown flag ``name`` (no dashes), or ''.

    ``known``: the flags (no dashes) the command takes; ``prefix``: how the sentence writes
    a flag (``--`` on the command line, ``""`` for the Python API's keyword arguments).
    """
    known = list(known)
    target = KERAS_NAMES.get(name)
    if target in known:
        return f"did you mean {prefix}{target}? (Keras's {name})"
    if name in KERAS_ELSEWHERE:
        return f"Keras's {name} has no flag: {KERAS_ELSEWHERE[name]}"
    close = nearest(name, known)
    return f"did you mean {prefix}{close}?" if close else ""


def name_hint(name: str, known: Iterable[str]) -> str:
    """`` Did you mean `x`?`` for a name looked up among ``known`` (a module's), or ''."""
    close = nearest(name, known)
    return f" Did you mean `{close}`?" if close else ""


def attribute_hint(name: str, namespace: object) -> str:
    """``name_hint`` among the public callables of ``namespace`` (a model-zoo module): a
    function named ``custom_modle`` for ``--model_def ....custom_model``."""
    known = [n for n, value in vars(namespace).items() if callable(value) and not n.startswith("_")]
    return name_hint(name, known)
