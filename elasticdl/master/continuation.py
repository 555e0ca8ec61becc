"""What an interrupted training job leaves to continue from: its last complete checkpoint, and
the command that continues from it.

A job stopped by Ctrl-C names both, in its last message and in report.json (``checkpoint``,
``continue_command``). The command is the job's own flags (those not at their default) with
``--checkpoint_dir_for_init`` set to the checkpoint and ``--num_epochs`` set to the epochs
not yet finished: a
checkpoint restores the model, and the data is read again from the start of an epoch
(docs/getting_started.md#checkpoints).
"""

from __future__ import annotations

import shlex

from elasticdl import fs
from elasticdl.config import FLAGS, JobConfig
from elasticdl.model.checkpoint import complete_versions

# Flags a continued job does not repeat: it is a new job (named afresh: with --etcd_endpoints the
# old name would resume the old ledger) on the same checkpoint directory.
_NOT_REPEATED = ("job_name", "prediction_outputs")


def last_complete_checkpoint(checkpoint_dir: str) -> str:
    """The newest complete ``version-<N>`` directory under ``checkpoint_dir``, or ''. Structural
    (no file is read): it is named the moment Ctrl-C is pressed."""
    if not checkpoint_dir:
        return ""
    try:
        versions = complete_versions(checkpoint_dir)
    except OSError:
        return ""
    return fs.join(checkpoint_dir, f"version-{versions[-1]}") if versions else ""


def continue_command(config: JobConfig, checkpoint: str, epochs_done: int) -> str:
    """``elasticdl train ...`` that continues ``config``'s job from ``checkpoint`` (a version
    directory); ``''`` without one, or with every epoch done."""
    epochs_left = config.training.num_epochs - epochs_done
    if not checkpoint or epochs_left <= 0:
        return ""
    defaults = JobConfig().to_flags()
    flags = {name: text for name, text in config.to_flags().items()
             if text != defaults[name] and name not in _NOT_REPEATED}
    flags["checkpoint_dir_for_init"] = checkpoint
    flags["num_epochs"] = epochs_left
    words = ["elasticdl", "train"]
    for name in FLAGS:  # in the order of --help
        if name in flags:
            words += [f"--{name}", _text(flags[name])]
    return shlex.join(words)


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
