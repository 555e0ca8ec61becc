"""Errors raised while locating, counting or reading training data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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


class BadRecord(NamedTuple):
    """A record no model can train on: corrupt, unparseable, or rejected by the model or loss."""

    path: str
    index: int  # in the file, from 0 (a CSV header line is not a record)
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: record {self.index}: {self.reason.rstrip('.')}"


# A message lists this many bad records; the report lists every one.
_LISTED = 5


class BadRecordError(DataError):
    """Bad records in the data, more than --max_bad_records allows (0 by default)."""

    def __init__(self, records: Sequence[BadRecord], max_bad_records: int = 0, skippable: bool = True) -> None:
        self.records = list(records)
        self.max_bad_records = max_bad_records
        listed = "; ".join(str(r) for r in self.records[:_LISTED])
        more = f"; and {len(self.records) - _LISTED} more" if len(self.records) > _LISTED else ""
        if not skippable:  # predict: a skipped record would shift every prediction after it
            lead = (f"bad record{'s' if len(self.records) > 1 else ''}: {listed}{more}. Fix or remove "
                    f"{'them' if len(self.records) > 1 else 'it'}: `elasticdl predict` skips no record, so "
                    "that each prediction stays on the line of its input")
        elif max_bad_records:
            lead = (f"{len(self.records)} bad records, more than --max_bad_records={max_bad_records}: "
                    f"{listed}{more}. Fix or remove them, or raise --max_bad_records")
        else:
            lead = (f"bad record{'s' if len(self.records) > 1 else ''}: {listed}{more}. Fix or remove "
                    f"{'them' if len(self.records) > 1 else 'it'}, or pass --max_bad_records N to skip "
                    "up to N bad records (the report lists each one)")
        super().__init__(lead)
