"""The job's Kubernetes objects as plain dicts: names, labels, pods, services, the job's Secret.

Pure functions of a JobConfig: tests validate every manifest against the Kubernetes
OpenAPI schema, ``--yaml`` dumps them, and the client wrapper sends them as they are.

Secrets: the job's Secret holds its token and the value of every ``--envs`` variable (all
of them count as secrets: the simple rule that never guesses wrong). Pods read them with
``secretKeyRef``; no pod spec and no job config handed to a pod holds a value of
``--envs`` (``without_secret_values``). Every pod runs with a restricted securityContext
(``POD_SECURITY``, ``CONTAINER_SECURITY``): the Pod Security Standard "restricted".
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from elasticdl.config import JobConfig
from elasticdl.config import kubernetes as options
from elasticdl.launch.api import ROLE_ENV
from elasticdl.rpc.auth import TOKEN_FILE_ENV
from elasticdl.rpc.trust import JOB_KEY_FILE_ENV, JOB_KEY_FILE_NAME

# The master pod prints its report on one line after this marker; the client picks it up.
REPORT_MARKER = "ELASTICDL_REPORT "

MASTER_PORT = 50001
PS_PORT = 2222
APP_LABEL = "elasticdl"
JOB_LABEL = "elasticdl-job-name"
ROLE_LABEL = "elasticdl-replica-type"
INDEX_LABEL = "elasticdl-replica-index"
CONTAINER_NAME = "main"
SERVICE_ACCOUNT = "elasticdl"  # dockerfiles/deploy.yaml: the master's rights (pods, services)
TOKEN_MOUNT = "/etc/elasticdl/token"
TOKEN_KEY = "token"  # the key of the token in the job's Secret
ENV_KEY_PREFIX = "env."  # the Secret's key of --envs variable NAME: env.NAME
# The job key (elasticdl/rpc/trust.py) lives in a Secret of its own, mounted in the master and PS
# pods only: a worker (which holds the token) never sees it, so it cannot sign tickets or
# mint another worker's credential.
KEYS_MOUNT = "/etc/elasticdl/keys"
KEYS_ROLES = ("master", "ps")
RUN_AS_USER = 1000  # the non-root user of the images (dockerfiles/Dockerfile.*: USER 1000:1000)
# The Pod Security Standard "restricted", for every pod of a job. fsGroup makes the mounted
# token (mode 0400, owned by root) readable by the group, and volumes writable by the user.
POD_SECURITY = {
    "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER, "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "privileged": False,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}
GRACE_SECONDS = 30
# Environment the pods read (set from the pod itself through the downward API).
POD_IP_ENV = "ELASTICDL_POD_IP"
POD_NAME_ENV = "ELASTICDL_POD_NAME"
POD_UID_ENV = "ELASTICDL_POD_UID"
NAMESPACE_ENV = "ELASTICDL_NAMESPACE"
JOB_CONFIG_ENV = "ELASTICDL_JOB_CONFIG"  # the master pod: its JobConfig as JSON
CLUSTER_SPEC_ENV = "ELASTICDL_CLUSTER_SPEC"  # the master pod: the --cluster_spec source


@dataclass(frozen=True)
class JobNames:
    """``elasticdl-<job>-master``, ``elasticdl-<job>-ps-<i>``, ``elasticdl-<job>-worker-<i>``."""

    job_name: str

    @property
    def prefix(self) -> str:
        return options.name_prefix(self.job_name)

    def pod(self, role: str, index: int = 0) -> str:
        return f"{self.prefix}-master" if role == "master" else f"{self.prefix}-{role}-{index}"

    def service(self, role: str, index: int = 0) -> str:
        return self.pod(role, index)

    @property
    def secret(self) -> str:
        return f"{self.prefix}-token"

    @property
    def keys_secret(self) -> str:
        return f"{self.prefix}-keys"

    def labels(self, role: str, index: int = 0) -> dict[str, str]:
        return {
            "app": APP_LABEL,
            JOB_LABEL: self.job_name,
            ROLE_LABEL: role,
            INDEX_LABEL: str(index),
        }

    def selector(self, role: str | None = None) -> str:
        parts = [f"app={APP_LABEL}", f"{JOB_LABEL}={self.job_name}"]
        if role:
            parts.append(f"{ROLE_LABEL}={role}")
        return ",".join(parts)


@dataclass(frozen=True)
class RoleSpec:
    """What differs between the master, PS and worker pods of one job."""

    requests: dict[str, str]
    limits: dict[str, str]
    priority_class: str = ""


def role_spec(config: JobConfig, role: str, priority: str | None = None) -> RoleSpec:
    k8s = config.kubernetes
    requests, limits = k8s.resources(role)
    if priority is None:
        priority = {"master": k8s.master_pod_priority, "ps": k8s.ps_pod_priority}.get(role, "")
    return RoleSpec(requests, limits, options.priority_class(priority) if priority else "")


@dataclass
class PodPlan:
    """One pod to create: the role's command and the job-wide settings."""

    role: str
    index: int
    command: list[str]
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None  # served port: a readiness probe, and the service's target
    owner: dict | None = None  # ownerReference (the master pod) for PS and worker pods
    service_account: str = ""  # empty: no API token in the pod


def owner_reference(pod: dict) -> dict:
    """An ownerReference to a created pod (the master): deleting it deletes its dependents."""
    return {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def env_secret_key(name: str) -> str:
    """The key of ``--envs`` variable ``name`` in the job's Secret."""
    return ENV_KEY_PREFIX + name


def without_secret_values(config: JobConfig) -> JobConfig:
    """``config`` as handed to the pods: each ``--envs`` variable's name, never its value
    (pods read the value from the job's Secret)."""
    if not any(config.kubernetes.envs.values()):
        return config
    return config.replace(envs={name: "" for name in config.kubernetes.envs})


def _secret_env(name: str, secret: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": env_secret_key(name)}}}


def pod_manifest(config: JobConfig, plan: PodPlan, spec: RoleSpec) -> dict:
    names = JobNames(config.job.job_name)
    env = [
        _field_env(POD_IP_ENV, "status.podIP"),
        _field_env(POD_NAME_ENV, "metadata.name"),
        _field_env(POD_UID_ENV, "metadata.uid"),
        _field_env(NAMESPACE_ENV, "metadata.namespace"),
        {"name": TOKEN_FILE_ENV, "value": f"{TOKEN_MOUNT}/{TOKEN_KEY}"},
    ]
    env += [{"name": k, "value": v} for k, v in ROLE_ENV.items()]
    env += [_secret_env(k, names.secret) for k in config.kubernetes.envs]  # values: in the Secret
    env += [{"name": k, "value": v} for k, v in plan.env.items()]
    volumes: list[dict[str, Any]] = [
        {"name": "elasticdl-token", "secret": {"secretName": names.secret, "defaultMode": 0o400}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "elasticdl-token", "mountPath": TOKEN_MOUNT, "readOnly": True}]
    if plan.role in KEYS_ROLES:
        env.append({"name": JOB_KEY_FILE_ENV, "value": f"{KEYS_MOUNT}/{JOB_KEY_FILE_NAME}"})
        volumes.append({"name": "elasticdl-keys", "secret": {"secretName": names.keys_secret, "defaultMode": 0o400}})
        mounts.append({"name": "elasticdl-keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    for i, volume in enumerate(config.kubernetes.volume):
        name = f"volume-{i}"
        if volume.claim_name:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": volume.claim_name}})
        else:
            volumes.append({"name": name, "hostPath": {"path": volume.host_path}})
        mount = {"name": name, "mountPath": volume.mount_path}
        if volume.sub_path:
            mount["subPath"] = volume.sub_path
        if volume.read_only:
            mount["readOnly"] = True
        mounts.append(mount)
    resources: dict[str, Any] = {"requests": dict(spec.requests)}
    if spec.limits:
        resources["limits"] = dict(spec.limits)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": config.kubernetes.image_name,
        "imagePullPolicy": config.kubernetes.image_pull_policy,
        "command": list(plan.command),
        "args": list(plan.args),
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),  # a copy: a hook may change it
    }
    if plan.port is not None:
        container["ports"] = [{"name": "grpc", "containerPort": plan.port, "protocol": "TCP"}]
        container["readinessProbe"] = {
            "tcpSocket": {"port": plan.port}, "periodSeconds": 1, "failureThreshold": 3,
        }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the master, not the kubelet, replaces pods
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [container],
        "volumes": volumes,
    }
    if plan.service_account:
        pod_spec["serviceAccountName"] = plan.service_account
    else:
        pod_spec["automountServiceAccountToken"] = False  # PS and workers never call the API
    if spec.priority_class:
        pod_spec["priorityClassName"] = spec.priority_class
    metadata: dict[str, Any] = {
        "name": names.pod(plan.role, plan.index),
        "namespace": config.kubernetes.namespace,
        "labels": names.labels(plan.role, plan.index),
    }
    if plan.owner:
        metadata["ownerReferences"] = [plan.owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def service_manifest(config: JobConfig, role: str, index: int, port: int, owner: dict | None) -> dict:
    """A ClusterIP service in front of one pod: its address survives the pod's relaunch."""
    names = JobNames(config.job.job_name)
    metadata: dict[str, Any] = {
        "name": names.service(role, index),
        "namespace": config.kubernetes.namespace,
        "labels": names.labels(role, index),
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    selector = {JOB_LABEL: config.job.job_name, ROLE_LABEL: role, INDEX_LABEL: str(index)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def secret_manifest(config: JobConfig, token: str, owner: dict | None) -> dict:
    """The job's Secret: its token and the value of every ``--envs`` variable."""
    names = JobNames(config.job.job_name)
    metadata: dict[str, Any] = {
        "name": names.secret,
        "namespace": config.kubernetes.namespace,
        "labels": names.labels("master"),
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    data = {TOKEN_KEY: token, **{env_secret_key(k): v for k, v in config.kubernetes.envs.items()}}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "immutable": True, "stringData": data}


def keys_secret_manifest(config: JobConfig, key: str, owner: dict | None) -> dict:
    """The job's keys Secret: the job key, for the master and PS pods only."""
    names = JobNames(config.job.job_name)
    metadata: dict[str, Any] = {
        "name": names.keys_secret,
        "namespace": config.kubernetes.namespace,
        "labels": names.labels("master"),
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "immutable": True, "stringData": {JOB_KEY_FILE_NAME: key}}


def master_pod_manifest(config: JobConfig, command: str, cluster_spec_source: str = "") -> dict:
    env = {JOB_CONFIG_ENV: without_secret_values(config).to_json()}
    if cluster_spec_source:
        env[CLUSTER_SPEC_ENV] = cluster_spec_source
    plan = PodPlan(
        role="master", index=0,
        command=["python", "-m", "elasticdl.cli.master_pod"], args=["--command", command],
        env=env, port=MASTER_PORT, service_account=SERVICE_ACCOUNT,
    )
    return pod_manifest(config, plan, role_spec(config, "master"))


def dumps_yaml(objects: list[dict]) -> str:
    import yaml

    return "---\n".join(yaml.safe_dump(obj, sort_keys=False, default_flow_style=False) for obj in objects)


def describe(obj: dict) -> str:
    return f"{obj['kind'].lower()} {obj['metadata']['name']}"


def compact_json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


class ClusterSpec:
    """The --cluster_spec hook: ``with_pod(pod) -> pod`` and ``with_service(service) -> service``.

    The file defines them as functions, or as methods of an object named ``cluster`` (the
    original ElasticDL's form). Each gets a manifest dict and returns it (or changes it in
    place and returns None).
    """

    def __init__(self, source: str = "", filename: str = "<cluster_spec>"):
        self.source = source
        self._namespace: dict[str, Any] = {}
        if source:
            # Bandit B102 (exec) is justified: this is the submitter's own --cluster_spec file, run by
            # design in the submitter's client and in the job's master pod, which runs their model code anyway.
            exec(compile(source, filename, "exec"), self._namespace)  # nosec

    @classmethod
    def from_file(cls, path: str) -> ClusterSpec:
        if not path:
            return cls()
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as err:
            raise options.OptionError(f"--cluster_spec {path!r} cannot be read: {err}") from None
        try:
            return cls(source, path)
        except Exception as err:
            raise options.OptionError(f"--cluster_spec {path!r} failed to load: {type(err).__name__}: {err}") from None

    def _hook(self, name: str):
        if name in self._namespace:
            return self._namespace[name]
        cluster = self._namespace.get("cluster")
        return getattr(cluster, name, None) if cluster is not None else None

    def _apply(self, name: str, obj: dict) -> dict:
        hook = self._hook(name)
        if hook is None:
            return obj
        result = hook(obj)
        return obj if result is None else result

    def with_pod(self, pod: dict) -> dict:
        return self._apply("with_pod", pod)

    def with_service(self, service: dict) -> dict:
        return self._apply("with_service", service)
