"""Where a pushed batch's records are: named by the worker, kept by the PS (ps/data_position.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchPosition:
    """A training push's records: ``records`` records of task ``task_id`` ending before index
    ``records_end`` of the task's file, trained under the master's hand-out ``handout``.
    ``ticket``: the master's signature of that hand-out (elasticdl/rpc/trust.py), which the PS
    checks before it takes the push."""

    task_id: int
    handout: int
    records_end: int
    records: int
    ticket: bytes = field(default=b"", repr=False)  # 72 bytes of no use in a log line
