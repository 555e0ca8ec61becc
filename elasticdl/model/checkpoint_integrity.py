"""Checksums of PS checkpoint shards: a shard counts only once its bytes verify.

A shard file (elasticdl/model/checkpoint.py) carries ``__sha256__``: the sha256 of every
other array in it (name, dtype, shape and bytes, in name order). It is inside the file, so
it is written in the same atomic rename as the data: a shard is never there without it.
Reading a shard back recomputes it; a truncated file, garbage, or a flipped bit makes the
shard *damaged* (DamagedCheckpointError, naming the file and what is wrong), and the cut it
belongs to is passed over for the previous complete one (``checkpoint.usable_cuts``).

Shards written before checksums (no ``__sha256__``) still load: they are read whole, so the
zip format's own CRC-32 of each array still catches a damaged byte, and a truncated file
still fails to open. They are *unverified but complete*, and said so once in the log.

Verifying reads the whole file; the result is remembered per (path, size, mtime) for local
files, so a cut the master checked is not hashed again when it reads its data position.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import zipfile
import zlib

import numpy as np

from elasticdl import fs
from elasticdl.errors import UserError

logger = logging.getLogger(__name__)

CHECKSUM_KEY = "__sha256__"

# What reading a damaged .npz raises: a cut off zip (BadZipFile, EOFError), a bad CRC
# (BadZipFile), garbage in an array's header (ValueError), a missing member (KeyError).
READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, KeyError, OSError, IndexError)

_verified: dict[tuple[str, int, int], bool] = {}  # (path, size, mtime_ns) -> it carried a checksum
_said_unverified: set[str] = set()


class CheckpointError(UserError, ValueError):
    """No usable checkpoint where one was asked for."""


class DamagedCheckpointError(CheckpointError):
    """A shard file whose bytes do not verify (truncated, overwritten, a bit flipped)."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"checkpoint shard {path} is damaged: {problem}")
        self.path = path
        self.problem = problem


def digest(arrays: dict[str, np.ndarray]) -> str:
    """The sha256 of ``arrays`` (the checksum key itself left out), independent of their order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        if name == CHECKSUM_KEY:
            continue
        value = np.asarray(arrays[name])
        # The name, dtype and shape too: the same bytes under another name are another shard.
        h.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def with_checksum(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` and their checksum, ready for np.savez."""
    return {**arrays, CHECKSUM_KEY: np.array(digest(arrays))}


def open_shard(path: str):
    """np.load of a shard file (local or remote); DamagedCheckpointError when it is no .npz."""
    try:
        source = io.BytesIO(fs.read_bytes(path)) if fs.is_remote(path) else path
        return np.load(source)
    except READ_ERRORS as err:
        raise DamagedCheckpointError(path, _describe(err)) from None


def verify_shard(path: str) -> bool:
    """Raise DamagedCheckpointError unless the shard at ``path`` reads whole and its checksum (if
    it has one) matches. True if it carried a checksum, False for an unverified older shard."""
    key = _cache_key(path)
    if key is not None and key in _verified:
        return _verified[key]
    with open_shard(path) as data:
        try:
            arrays = {name: data[name] for name in data.files}
        except READ_ERRORS as err:
            raise DamagedCheckpointError(path, _describe(err)) from None
    recorded = arrays.get(CHECKSUM_KEY)
    if recorded is None:
        if path not in _said_unverified:
            _said_unverified.add(path)
            logger.info("checkpoint shard %s has no checksum (written by an older ElasticDL): it is used "
                        "unverified (its zip CRCs are checked)", path)
        checked = False
    else:
        actual = digest(arrays)
        if str(recorded) != actual:
            raise DamagedCheckpointError(path, f"its sha256 is {actual[:12]}..., the shard recorded "
                                               f"{str(recorded)[:12]}... when it was written")
        checked = True
    if key is not None:
        _verified[key] = checked
    return checked


def _cache_key(path: str) -> tuple[str, int, int] | None:
    if fs.is_remote(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def _describe(err: BaseException) -> str:
    kind = "truncated or not a checkpoint" if isinstance(err, (zipfile.BadZipFile, EOFError)) else "unreadable"
    return f"{kind} ({type(err).__name__}: {err})"
