"""`elasticdl zoo init|build|push`: init writes the Dockerfile; build and push need a Docker engine,
which does not run here, so they must fail with a message that says so."""

from __future__ import annotations

import subprocess
import sys

from elasticdl.cli import zoo


def run(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticdl", "zoo", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_init_writes_a_dockerfile_from_the_base_image(tmp_path):
    (tmp_path / "requirements.txt").write_text("pandas\n")
    result = run("init", "--model_zoo", str(tmp_path), "--base_image", "registry.example.com/elasticdl:gpu",
                 "--extra_pypi_index", "https://pypi.example.com/simple")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "Dockerfile").read_text()
    assert text.splitlines()[1:] == [
        "FROM registry.example.com/elasticdl:gpu",
        "COPY . /model_zoo",
        "USER root",
        "RUN pip install --no-cache-dir -r /model_zoo/requirements.txt "
        "--extra-index-url https://pypi.example.com/simple",
        "ENV ELASTICDL_MODEL_ZOO=/model_zoo",
        "USER 1000:1000",  # the pods' runAsUser: the image runs as non-root too
    ]


def test_init_without_requirements_installs_nothing(tmp_path):
    zoo.init(str(tmp_path))
    text = (tmp_path / "Dockerfile").read_text()
    assert f"FROM {zoo.DEFAULT_BASE_IMAGE}" in text and "RUN" not in text
    assert text.splitlines()[-1] == "USER 1000:1000" and "USER root" not in text


def test_build_and_push_without_a_docker_engine_fail_clearly(tmp_path):
    zoo.init(str(tmp_path))
    env = {"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock", "PATH": "/usr/bin:/bin"}
    for action in ("build", "push"):
        result = run(action, "--model_zoo", str(tmp_path), "--image_name", "me/zoo:v1", env=env)
        assert result.returncode == 2
        assert "cannot reach the Docker engine" in result.stderr and "DOCKER_HOST" in result.stderr
    result = run("build", "--model_zoo", str(tmp_path))
    assert result.returncode == 2 and "needs --image_name" in result.stderr


def test_image_names_and_tags():
    assert zoo.split_tag("registry:5000/me/zoo:v1") == ("registry:5000/me/zoo", "v1")
    assert zoo.split_tag("registry:5000/me/zoo") == ("registry:5000/me/zoo", "latest")
