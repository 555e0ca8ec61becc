"""Errors raised while locating, counting or reading training data."""

from __future__ import annotations

from elasticdl.errors import UserError


class DataError(UserError, ValueError):
    """A data file is missing, malformed, or a requested range is invalid."""


class CorruptRecordError(DataError):
    """A record's framing or checksum is wrong; the file is truncated or corrupt."""

    def __init__(self, path: str, index: int, offset: int, problem: str) -> None:
        self.path = path
        self.index = index
        self.offset = offset
        self.problem = problem
        super().__init__(
            f"{path}: record {index} at byte {offset}: {problem} "
            "(file truncated or corrupt). Regenerate the file or remove it "
            "from --training_data."
        )


class NoDataFilesError(DataError):
    """A data spec matched no files."""
