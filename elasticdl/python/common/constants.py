"""The original's ``elasticdl.python.common.constants`` names a model zoo imports: ``Mode``, and
``MaxComputeConfig`` (the environment variables that configure ODPS/MaxCompute access, read by
``elasticdl.python.data.odps_io.is_odps_configured``; ``ODPSConfig`` is its older name)."""

from elasticdl.mode import Mode


class MaxComputeConfig:
    """Names of the environment variables of a MaxCompute (ODPS) project, as the original's.

    Only the names: ElasticDL reads no ODPS table (see elasticdl.python.data.odps_io)."""

    PROJECT_NAME = "MAXCOMPUTE_PROJECT"
    ACCESS_ID = "MAXCOMPUTE_AK"
    ACCESS_KEY = "MAXCOMPUTE_SK"
    ENDPOINT = "MAXCOMPUTE_ENDPOINT"
    TUNNEL_ENDPOINT = "MAXCOMPUTE_TUNNEL_ENDPOINT"


ODPSConfig = MaxComputeConfig

__all__ = ["MaxComputeConfig", "Mode", "ODPSConfig"]
