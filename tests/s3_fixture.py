"""A real S3 HTTP API on loopback: moto's server mode, talked to through s3fs as users do.

``s3`` (session-scoped) starts ``moto.server`` on a free port and yields an :class:`S3`
with the environment a job needs (``AWS_ENDPOINT_URL``, test credentials); ``s3_env``
puts it into this process's environment for one test. Each test makes its own bucket.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probe for credentials
        }

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": self.endpoint},
                                 skip_instance_cache=True)

    def new_bucket(self, prefix: str = "elasticdl") -> str:
        name = f"{prefix}-{secrets.token_hex(4)}"
        self.filesystem().mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:  # until the server answers (it imports for a few seconds first)
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.1)
        yield S3(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """This process talks to the moto endpoint, with fresh s3fs clients (none cached from another test)."""
    import s3fs

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3
    s3fs.S3FileSystem.clear_instance_cache()
