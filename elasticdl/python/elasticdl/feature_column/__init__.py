"""``from elasticdl.python.elasticdl.feature_column import feature_column`` (the original's path)."""

from elasticdl.python.elasticdl.feature_column import feature_column

__all__ = ["feature_column"]
