"""Shared fixtures."""

import os
import shutil
import tempfile

import pytest
from etcd_fixture import etcd_process, etcd_server  # noqa: F401  (pytest finds fixtures by name)
from hypothesis import settings
from s3_fixture import s3, s3_env  # noqa: F401

# The suite explores the same examples on every run, so a test that passed here passes in CI.
# To search further, run with HYPOTHESIS_PROFILE=explore (random examples, as many as asked).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def job_token():
    """Every gRPC server refuses to start without a job token (elasticdl/rpc/auth.py): the
    tests act as one job whose token file is named in the environment, as in a pod, so a
    server or client a test makes, and every process it starts, has it. Tests of the token
    itself (tests/test_k8s_security.py, tests/test_local_security.py) set or unset it."""
    from elasticdl.rpc import auth

    directory = tempfile.mkdtemp(prefix="elasticdl-test-token-")
    path = auth.write_private(os.path.join(directory, "token"), auth.new_token() + "\n")
    previous = os.environ.get(auth.TOKEN_FILE_ENV)
    os.environ[auth.TOKEN_FILE_ENV] = path
    yield path
    shutil.rmtree(directory, ignore_errors=True)
    if previous is None:
        os.environ.pop(auth.TOKEN_FILE_ENV, None)
    else:
        os.environ[auth.TOKEN_FILE_ENV] = previous


@pytest.fixture(autouse=True)
def local_spares(request, monkeypatch):
    """Local jobs keep no warm spares (ELASTICDL_LOCAL_SPARES=0, elasticdl/launch/local.py)
    unless a test is marked ``warm_spares``: a kept spare is one more process importing
    TensorFlow per job, which on CI's 2 cores costs the suite about a minute without
    telling anything about what the job computes. The tests of spares themselves (the
    orphan and bad-zoo tests, the chaos test, the documented commands, test_warm_spares)
    run them as users get them."""
    from elasticdl.launch.local import SPARES_ENV

    if request.node.get_closest_marker("warm_spares") is None:
        monkeypatch.setenv(SPARES_ENV, "0")
