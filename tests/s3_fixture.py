"""A real S3 HTTP API on loopback: moto's server mode, talked to through s3fs as users do.

``s3`` (session-scoped) starts ``moto.server`` on a free port (benchmarks/parquet_s3.py's
``moto_s3_server``, which the benchmark uses too) and yields an :class:`S3`
with the environment a job needs (``AWS_ENDPOINT_URL``, test credentials); ``s3_env``
puts it into this process's environment for one test. Each test makes its own bucket.
"""

from __future__ import annotations

import secrets

import pytest


class S3:
    def __init__(self, env: dict[str, str]):
        self.env = env  # AWS_ENDPOINT_URL, credentials (a fresh secret), no instance-metadata probe
        self.endpoint = env["AWS_ENDPOINT_URL"]

    def filesystem(self):
        import s3fs

        s3 = s3fs.S3FileSystem(key=self.env["AWS_ACCESS_KEY_ID"], secret=self.env["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": self.endpoint},
                               # A request the server never answers fails the test in seconds,
                               # not after s3fs's and botocore's retries (minutes).
                               config_kwargs={"read_timeout": 20, "retries": {"max_attempts": 1}},
                               skip_instance_cache=True)
        s3.retries = 1  # s3fs's own retries, on top of botocore's
        return s3

    def new_bucket(self, prefix: str = "elasticdl") -> str:
        name = f"{prefix}-{secrets.token_hex(4)}"
        self.filesystem().mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3():
    from benchmarks.parquet_s3 import moto_s3_server  # the benchmark starts the same server

    with moto_s3_server() as env:
        yield S3(env)


@pytest.fixture
def s3_env(s3, monkeypatch):
    """This process talks to the moto endpoint, with fresh s3fs clients (none cached from another test)."""
    import s3fs

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3
    s3fs.S3FileSystem.clear_instance_cache()
