"""``from elasticdl.python.data.odps_io import ODPSWriter, is_odps_configured`` (the original's
path): ``is_odps_configured`` tells, as the original did, whether the MaxCompute environment
variables are set; ``ODPSReader`` and ``ODPSWriter`` refuse when constructed, naming what to use
instead (a module that only builds them when ODPS is configured runs unchanged without it)."""

from __future__ import annotations

import os

from elasticdl.python.common.constants import MaxComputeConfig
from elasticdl.python.data.refusals import ODPS_READ, ODPS_WRITE, refuse


def is_odps_configured() -> bool:
    """True when the project, access id, access key and endpoint variables are all set."""
    names = (MaxComputeConfig.PROJECT_NAME, MaxComputeConfig.ACCESS_ID,
             MaxComputeConfig.ACCESS_KEY, MaxComputeConfig.ENDPOINT)
    return all(os.environ.get(name) for name in names)


class ODPSReader:
    def __init__(self, *args, **kwargs):
        raise refuse(ODPS_READ, "ODPSReader")


class ODPSWriter:
    def __init__(self, *args, **kwargs):
        raise refuse(ODPS_WRITE, "ODPSWriter")


__all__ = ["ODPSReader", "ODPSWriter", "is_odps_configured"]
