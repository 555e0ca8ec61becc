"""What a PS takes from a push before it looks at the gradient: the fields no worker sends
wrong, and the master's ticket for the task the push names (elasticdl/rpc/trust.py).

Pure Python: the ParameterServer calls ``check_push`` under its lock; a GradientError leaves
the shard, its version and its data position unchanged (the push is REJECTED_INVALID).
"""

from __future__ import annotations

from elasticdl.model.optimizers import learning_rate_problem
from elasticdl.ps.parameters import GradientError
from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.trust import TicketVerifier


def check_push(version: int, learning_rate: float | None, batch: BatchPosition | None, worker_id: int,
               verifier: TicketVerifier | None) -> None:
    """GradientError naming the first problem of a push's version, rate, batch position or ticket."""
    _check_push_fields(version, learning_rate)
    if batch is None:
        # A push naming no task (a tool's, a benchmark's) moves no data position, so it cannot
        # forge the exactly-once evidence; the gradient guard bounds what it does to the model.
        return
    _check_batch(batch)
    if verifier is not None:
        problem = verifier.problem(batch.ticket, batch.task_id, batch.handout, worker_id, batch.records_end,
                                   batch.records)
        if problem:
            raise GradientError(problem)


def _check_batch(batch: BatchPosition) -> None:
    """GradientError for a batch position no worker sends."""
    if min(batch.task_id, batch.handout, batch.records_end, batch.records) < 0 or batch.records > batch.records_end:
        raise GradientError(
            f"batch position {batch}: task, hand-out, end and records are never negative, and a batch "
            "never holds more records than end at"
        )


def _check_push_fields(version: int, learning_rate: float | None) -> None:
    """GradientError for a push's version or learning rate that no worker sends."""
    if version < 0:
        raise GradientError(
            f"gradient computed on version {version}: a version is never negative (pull before pushing)"
        )
    problem = learning_rate_problem(learning_rate) if learning_rate is not None else ""
    if problem:
        raise GradientError(problem)
