"""The error of bad embedding input (ids, rows, table settings)."""

from __future__ import annotations

from elasticdl.errors import UserError


class EmbeddingError(UserError, ValueError):
    """Bad embedding input (ids, rows, table name); nothing was changed.

    The gRPC edge answers it with INVALID_ARGUMENT.
    """
