"""``elasticdl zoo init|build|push``: the Docker image a Kubernetes job runs.

- ``init`` writes ``<model_zoo>/Dockerfile``: FROM an ElasticDL base image (dockerfiles/),
  the model zoo copied to ``/model_zoo``, its ``requirements.txt`` installed.
- ``build`` sends the model zoo directory to the Docker engine and builds ``--image_name``.
- ``push`` pushes ``--image_name`` to its registry (credentials from ~/.docker/config.json).

``build`` and ``push`` talk to the Docker engine API directly ($DOCKER_HOST, default
unix:///var/run/docker.sock; or --docker_base_url), with no Docker SDK to install.

Example::

    elasticdl zoo init --model_zoo model_zoo --base_image elasticdl:cpu
    elasticdl zoo build --model_zoo model_zoo --image_name registry.example.com/me/digits:v1
    elasticdl zoo push --image_name registry.example.com/me/digits:v1
    elasticdl train --backend kubernetes --image_name registry.example.com/me/digits:v1 --model_zoo /model_zoo ...
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import socket
import sys
import tarfile
from urllib.parse import quote, urlparse

from elasticdl.cli.argparser import ElasticDLParser
from elasticdl.errors import REPORTED, UserError, report_exit
from elasticdl.launch.kubernetes.manifests import RUN_AS_USER

DEFAULT_BASE_IMAGE = "elasticdl:cpu"
ZOO_MOUNT = "/model_zoo"
ACTIONS = {
    "init": "write a Dockerfile into --model_zoo",
    "build": "build --image_name from --model_zoo through the Docker engine",
    "push": "push --image_name to its registry",
}
HELP = "Build the Docker image of a model zoo for --backend kubernetes: init, build or push."


class ZooError(UserError, RuntimeError):
    """The message says what failed and what to do."""


def dockerfile(base_image: str, has_requirements: bool, extra_pypi_index: str = "") -> str:
    lines = [
        "# Written by `elasticdl zoo init`; build it with `elasticdl zoo build`.",
        f"FROM {base_image}",
        f"COPY . {ZOO_MOUNT}",
    ]
    if has_requirements:
        index = f" --extra-index-url {extra_pypi_index}" if extra_pypi_index else ""
        lines.append("USER root")  # pip installs where the non-root user may not write
        lines.append(f"RUN pip install --no-cache-dir -r {ZOO_MOUNT}/requirements.txt{index}")
    lines.append(f"ENV ELASTICDL_MODEL_ZOO={ZOO_MOUNT}")
    lines.append(f"USER {RUN_AS_USER}:{RUN_AS_USER}")  # pods run as non-root (docs/kubernetes.md#security)
    return "\n".join(lines) + "\n"


def init(model_zoo: str, base_image: str = DEFAULT_BASE_IMAGE, extra_pypi_index: str = "") -> str:
    """Write ``<model_zoo>/Dockerfile``; returns its path."""
    if not os.path.isdir(model_zoo):
        raise ZooError(f"--model_zoo {model_zoo!r} is not a directory")
    has_requirements = os.path.isfile(os.path.join(model_zoo, "requirements.txt"))
    path = os.path.join(model_zoo, "Dockerfile")
    with open(path, "w", encoding="utf-8") as f:
        f.write(dockerfile(base_image, has_requirements, extra_pypi_index))
    return path


# ------------------------------------------------------------------ Docker engine API


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class DockerEngine:
    """The few Docker engine API calls ``build`` and ``push`` need."""

    def __init__(self, base_url: str = "", timeout: float = 3600):
        self.base_url = base_url or os.environ.get("DOCKER_HOST", "") or "unix:///var/run/docker.sock"
        self.timeout = timeout

    def _connection(self) -> http.client.HTTPConnection:
        url = urlparse(self.base_url)
        if url.scheme == "unix":
            return _UnixConnection(url.path, self.timeout)
        if url.scheme in ("tcp", "http"):
            return http.client.HTTPConnection(url.hostname, url.port or 2375, timeout=self.timeout)
        raise ZooError(f"unsupported Docker engine address {self.base_url!r}: use unix:///path or tcp://host:port")

    def _stream(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = self._connection()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
        except OSError as err:
            raise ZooError(
                f"cannot reach the Docker engine at {self.base_url} ({err}). Start Docker, or point "
                "$DOCKER_HOST (or --docker_base_url) at a running engine."
            ) from None
        if resp.status >= 400:
            text = resp.read().decode("utf-8", errors="replace")
            try:
                text = json.loads(text).get("message", text)
            except ValueError:
                pass
            raise ZooError(f"the Docker engine refused {method} {path.split('?')[0]}: HTTP {resp.status}: {text}")
        # The engine answers with JSON messages, one per line: progress, then an error or success.
        for raw in resp:
            line = raw.strip()
            if not line:
                continue
            message = json.loads(line)
            if "error" in message:
                raise ZooError(message.get("error", "").strip())
            yield message
        conn.close()

    def build(self, context_dir: str, tag: str, out=sys.stderr) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(context_dir, arcname=".")
        query = f"/build?t={quote(tag, safe='')}&rm=1&forcerm=1"
        for message in self._stream("POST", query, buffer.getvalue(), {"Content-Type": "application/x-tar"}):
            if message.get("stream"):
                out.write(message["stream"])

    def push(self, image: str, out=sys.stderr) -> None:
        name, tag = split_tag(image)
        headers = {"X-Registry-Auth": registry_auth(name)}
        for message in self._stream("POST", f"/images/{quote(name, safe='')}/push?tag={quote(tag, safe='')}",
                                    b"", headers):
            status = message.get("status")
            if status and not message.get("progressDetail"):
                out.write(f"{message.get('id', '')} {status}".strip() + "\n")


def split_tag(image: str) -> tuple[str, str]:
    """``registry:5000/a/b:v1`` → (``registry:5000/a/b``, ``v1``); no tag → ``latest``."""
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = image.rsplit(":", 1)
        return name, tag
    return image, "latest"


def registry_auth(name: str) -> str:
    """The X-Registry-Auth header for the image's registry, from ~/.docker/config.json if any."""
    registry = name.split("/", 1)[0] if "/" in name and ("." in name.split("/")[0] or ":" in name.split("/")[0]) \
        else "https://index.docker.io/v1/"
    auth: dict = {}
    path = os.path.join(os.environ.get("DOCKER_CONFIG", os.path.expanduser("~/.docker")), "config.json")
    try:
        with open(path) as f:
            entry = (json.load(f).get("auths") or {}).get(registry) or {}
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            auth = {"username": user, "password": password, "serveraddress": registry}
    except (OSError, ValueError):
        pass
    return base64.urlsafe_b64encode(json.dumps(auth).encode()).decode()


# ------------------------------------------------------------------ CLI


def add_zoo_parser(sub) -> argparse.ArgumentParser:
    zoo = sub.add_parser("zoo", help=HELP, description=HELP)
    zoo.add_argument("action", choices=list(ACTIONS), metavar="ACTION",
                     help="; ".join(f"{k}: {v}" for k, v in ACTIONS.items()))
    zoo.add_argument("--model_zoo", default=".", metavar="MODEL_ZOO",
                     help="The model zoo directory (init, build) (default: '.').")
    zoo.add_argument("--base_image", default=DEFAULT_BASE_IMAGE, metavar="BASE_IMAGE",
                     help=f"init: the ElasticDL image to start FROM (default: {DEFAULT_BASE_IMAGE!r}).")
    zoo.add_argument("--extra_pypi_index", default="", metavar="EXTRA_PYPI_INDEX",
                     help="init: an extra package index for requirements.txt (default: '').")
    zoo.add_argument("--image_name", default="", metavar="IMAGE_NAME",
                     help="build, push: the image, e.g. registry.example.com/me/zoo:v1 (default: '').")
    zoo.add_argument("--docker_base_url", default="", metavar="DOCKER_BASE_URL",
                     help="build, push: the Docker engine (default: '': $DOCKER_HOST or the local socket).")
    return zoo


def main(argv: list[str]) -> int:
    """``argv`` starts with ``zoo``."""
    parser = ElasticDLParser(prog="elasticdl")
    add_zoo_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        if args.action == "init":
            path = init(args.model_zoo, args.base_image, args.extra_pypi_index)
            print(f"wrote {path}; now `elasticdl zoo build --model_zoo {args.model_zoo} --image_name IMAGE`")
            return 0
        if not args.image_name:
            raise ZooError(f"`elasticdl zoo {args.action}` needs --image_name")
        engine = DockerEngine(args.docker_base_url)
        if args.action == "build":
            if not os.path.isfile(os.path.join(args.model_zoo, "Dockerfile")):
                raise ZooError(f"{args.model_zoo} has no Dockerfile: run `elasticdl zoo init` first")
            engine.build(args.model_zoo, args.image_name)
            print(f"built {args.image_name}")
        else:
            engine.push(args.image_name)
            print(f"pushed {args.image_name}")
    except REPORTED as err:
        return report_exit(f"elasticdl zoo {args.action}", err)
    return 0
