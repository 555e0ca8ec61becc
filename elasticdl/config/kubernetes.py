"""The Kubernetes flags as typed values: resources, volumes, envs, priorities, names.

Pure functions (no Kubernetes client): the parsers run when a JobConfig is built from flags
(elasticdl/config/sections.py), ``validate_kubernetes_flags`` in ``JobConfig.validate``, so a
string that does not parse fails at submit time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticdl.errors import UserError

if TYPE_CHECKING:
    from elasticdl.config.job_config import JobConfig

IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# `high` and `low` name the PriorityClasses of dockerfiles/deploy.yaml; any other word is
# used as a PriorityClass name as it is.
PRIORITY_CLASSES = {"high": "elasticdl-high", "low": "elasticdl-low"}
RESOURCE_ALIASES = {"gpu": "nvidia.com/gpu"}
RESOURCE_FORM = "cpu=1,memory=4096Mi,gpu=1"

# A Kubernetes quantity: 1, 0.5, 500m, 4096Mi, 4G, 1e3 (k8s.io/apimachinery resource.Quantity).
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[munkKMGTPE]|[KMGTPE]i)?$")
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$", re.I)
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class OptionError(UserError, ValueError):
    """A Kubernetes flag that does not parse; the message names the flag and the expected form."""


def parse_resources(text: str, flag: str) -> dict[str, str]:
    """``"cpu=1,memory=4096Mi,gpu=1"`` → ``{"cpu": "1", "memory": "4096Mi", "nvidia.com/gpu": "1"}``."""
    resources: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not name or not value:
            raise OptionError(f"{flag}: cannot parse {item!r} in {text!r}; expected the form {RESOURCE_FORM}")
        name = RESOURCE_ALIASES.get(name, name)
        if not _RESOURCE_NAME.match(name):
            raise OptionError(f"{flag}: {name!r} in {text!r} is not a resource name (cpu, memory, gpu, ...)")
        if not _QUANTITY.match(value):
            raise OptionError(
                f"{flag}: {value!r} for {name} in {text!r} is not a Kubernetes quantity "
                f"(e.g. 1, 0.5, 500m, 4096Mi, 4Gi); expected the form {RESOURCE_FORM}"
            )
        if name in resources:
            raise OptionError(f"{flag}: {name} is given twice in {text!r}")
        resources[name] = value
    return resources


@dataclass(frozen=True)
class Volume:
    mount_path: str
    claim_name: str = ""
    host_path: str = ""
    sub_path: str = ""
    read_only: bool = False


_VOLUME_KEYS = {"claim_name", "host_path", "mount_path", "sub_path", "read_only"}
VOLUME_FORM = "claim_name=c,mount_path=/data or host_path=/x,mount_path=/data (several separated by ;)"


def parse_volumes(text: str, flag: str = "--volume") -> list[Volume]:
    volumes = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        fields: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in _VOLUME_KEYS or not value:
                raise OptionError(
                    f"{flag}: cannot parse {item!r} in {spec!r}; expected {VOLUME_FORM} "
                    f"(keys: {', '.join(sorted(_VOLUME_KEYS))})"
                )
            fields[key] = value
        if "mount_path" not in fields or not fields["mount_path"].startswith("/"):
            raise OptionError(f"{flag}: {spec!r} needs mount_path=/an/absolute/path; expected {VOLUME_FORM}")
        if ("claim_name" in fields) == ("host_path" in fields):
            raise OptionError(f"{flag}: {spec!r} needs exactly one of claim_name= or host_path=; expected {VOLUME_FORM}")
        read_only = fields.pop("read_only", "false").lower()
        if read_only not in ("true", "false"):
            raise OptionError(f"{flag}: read_only must be true or false in {spec!r}")
        volumes.append(Volume(read_only=read_only == "true", **fields))
    mounts = [v.mount_path for v in volumes]
    if len(set(mounts)) != len(mounts):
        raise OptionError(f"{flag}: two volumes share a mount_path in {text!r}")
    return volumes


def parse_envs(text: str, flag: str = "--envs") -> dict[str, str]:
    """``"A=1,B=x"`` → ``{"A": "1", "B": "x"}``: extra environment for every pod of the job."""
    envs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not _ENV_NAME.match(name):
            raise OptionError(f"{flag}: cannot parse {item!r} in {text!r}; expected NAME=value,NAME2=value2")
        envs[name] = value
    return envs


def priority_class(value: str) -> str:
    """The PriorityClass name for a --*_pod_priority value (empty: the cluster's default)."""
    return PRIORITY_CLASSES.get(value.strip().lower(), value.strip())


def name_prefix(job_name: str) -> str:
    """``elasticdl-<job>``, without doubling a job name that already starts with ``elasticdl-``."""
    return job_name if job_name.startswith("elasticdl-") else f"elasticdl-{job_name}"


# Service names are DNS-1035 labels (at most 63 characters); "-master" is the longest suffix.
MAX_PREFIX = 63 - len("-master")


def validate_kubernetes_flags(config: JobConfig) -> None:
    """Raise OptionError for Kubernetes flags that cannot work (resources, volumes and envs
    were parsed when the config was built)."""
    k8s, job_name = config.kubernetes, config.job.job_name
    if not k8s.image_name:
        raise OptionError(
            "--backend kubernetes needs --image_name: the image every pod runs "
            "(build it with `elasticdl zoo build`, see docs/kubernetes.md)"
        )
    prefix = name_prefix(job_name)
    if not _DNS_LABEL.match(job_name) or len(prefix) > MAX_PREFIX:
        raise OptionError(
            f"--job_name {job_name!r} cannot name Kubernetes pods and services: use lower-case "
            f"letters, digits and '-', starting with a letter, at most {MAX_PREFIX} characters with the "
            "elasticdl- prefix"
        )
    if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", k8s.namespace) or len(k8s.namespace) > 63:
        raise OptionError(f"--namespace {k8s.namespace!r} is not a valid namespace name")
    if k8s.image_pull_policy not in IMAGE_PULL_POLICIES:
        raise OptionError(
            f"--image_pull_policy must be one of {', '.join(IMAGE_PULL_POLICIES)}. "
            f"Received: {k8s.image_pull_policy!r}"
        )
    if k8s.cluster_spec and not k8s.cluster_spec.endswith(".py"):
        raise OptionError(f"--cluster_spec must be a Python file (.py). Received: {k8s.cluster_spec!r}")
