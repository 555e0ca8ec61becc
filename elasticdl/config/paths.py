"""Submit-time checks of the job's name and of the directories a job writes.

A job writes its outputs only at the end (the final checkpoint, the SavedModel, the joined
predictions, report.json), so a path that cannot be written must fail the submit, not the
job: each directory flag is checked to be a writable directory, or creatable (its nearest
existing parent a writable directory), with room left on its disk. Nothing is created: a
check leaves the file system as it found it.
"""

from __future__ import annotations

import os
import re
import shutil

from elasticdl import fs
from elasticdl.config.errors import ConfigError

# A DNS label (RFC 1123): the job name names runs/<job_name>/, the etcd keys
# /elasticdl/<job_name>/ and, on Kubernetes, pods, services and label values.
JOB_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_JOB_NAME = 63
# Less than this free on a job's disk is a full disk: logs, the report and the ledger need a little.
MIN_FREE_BYTES = 1 << 20


def check_job_name(name: str) -> None:
    """A ConfigError unless ``name`` is a DNS label (lower-case letters, digits, '-')."""
    if JOB_NAME.match(name) and len(name) <= MAX_JOB_NAME:
        return
    hint = ""
    if "/" in name or name.startswith("."):
        hint = " (it names the directory runs/<job_name>/: a path would write outside runs/)"
    elif len(name) > MAX_JOB_NAME:
        hint = f" (it has {len(name)})"
    raise ConfigError(
        f"--job_name {name!r} is not a valid job name{hint}: use lower-case letters, digits and '-', "
        f"starting and ending with a letter or digit, at most {MAX_JOB_NAME} characters, like "
        f"{suggest_job_name(name)!r}."
    )


def suggest_job_name(text: str, max_length: int = MAX_JOB_NAME) -> str:
    """``text`` made a valid job name: lower case, other characters as '-', cut to ``max_length``."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:max_length].strip("-")
    return name or "job"


def check_writable_dir(flag: str, path: str, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """A ConfigError unless ``path`` is a writable directory, or can be created as one, on a disk
    with at least ``min_free_bytes`` free."""
    if not path:
        return
    if fs.is_remote(path):  # an object store: the bucket is there and the credentials see it
        try:
            fs.check_bucket(path)
        except fs.StorageError as err:
            raise ConfigError(f"{flag} {err}") from None
        return
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{flag} {path!r} is a file, not a directory: name a directory (it is created if missing).")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{flag} {path!r} cannot be created: {existing!r} is a file, not a directory. Choose another path."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == full else f"cannot be created: {existing!r} is not writable"
        raise ConfigError(f"{flag} {path!r} {what} by this user. Choose a writable directory or fix its permissions.")
    free = shutil.disk_usage(existing).free
    if free < min_free_bytes:
        raise ConfigError(
            f"{flag} {path!r}: the disk holding {existing!r} has {_size(free)} free, and the job needs at "
            f"least {_size(min_free_bytes)} there. Free some space or choose a directory on another disk."
        )


def _size(n: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB")
    step = 0
    while n >= 1024 and step < len(units) - 1:
        n, step = n / 1024, step + 1
    return f"{int(n)} bytes" if step == 0 else f"{n:.2f} {units[step]}"
