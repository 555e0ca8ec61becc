"""The client side of ``elasticdl train --backend kubernetes``: submit the master, follow it.

The client creates the master pod, then (owned by it, so deleting the master deletes
them) the job's token Secret and the master's Service. The master pod creates the PS and
worker pods. Unless --detach, the client follows the master: it reports a master that
cannot be scheduled or cannot pull its image, streams its log, and ends with the master's
outcome: the report on success; on failure the master's exit code (elasticdl/errors.py):
2 when it found the input wrong, else 1. ``--yaml FILE`` writes the manifests instead of
submitting them, readable by the submitter only (0600: the file holds the job's Secret).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field

from elasticdl.config import ConfigError, JobConfig
from elasticdl.config.kubernetes import OptionError
from elasticdl.errors import EXIT_USER_ERROR, JobFailedError, UserError
from elasticdl.launch.kubernetes import manifests
from elasticdl.launch.kubernetes.client import K8sClient, K8sClusterError, K8sContainerError, K8sError
from elasticdl.launch.kubernetes.pod_state import FATAL_WAITING, view
from elasticdl.rpc.auth import new_token, write_private
from elasticdl.rpc.trust import new_job_key

logger = logging.getLogger(__name__)

PENDING_WARNING_SECONDS = 60.0


class MasterRefusedError(UserError):
    """The master pod found the input wrong (it exited with code 2): a flag, the model zoo or
    the data as seen inside the cluster. The last lines of its log say which."""


@dataclass
class SubmittedJob:
    job_name: str
    namespace: str
    master_pod: str
    yaml: str = ""
    report: dict = field(default_factory=dict)  # the master's JobReport, when followed to success

    def to_json(self) -> str:
        return json.dumps(self.report or {k: v for k, v in asdict(self).items() if k != "report"},
                          indent=2, sort_keys=True)


def build_master_objects(config: JobConfig, command: str, token: str) -> list[dict]:
    """[secret, service, pod] for the master, after the --cluster_spec hook (no owners yet)."""
    try:
        cluster_spec = manifests.ClusterSpec.from_file(config.kubernetes.cluster_spec)
        pod = cluster_spec.with_pod(manifests.master_pod_manifest(config, command, cluster_spec.source))
        service = cluster_spec.with_service(
            manifests.service_manifest(config, "master", 0, manifests.MASTER_PORT, None)
        )
    except OptionError as err:
        raise ConfigError(str(err)) from None
    return [manifests.secret_manifest(config, token, None), service, pod]


def submit(config: JobConfig, command: str, client: K8sClient | None = None) -> SubmittedJob:
    config.validate(command, check_paths=False)  # paths name files inside the image and volumes
    secret, service, pod = build_master_objects(config, command, new_token())
    keys = manifests.keys_secret_manifest(config, new_job_key(), None)  # the master's and the PS' only
    name = pod["metadata"]["name"]
    job = SubmittedJob(config.job.job_name, config.kubernetes.namespace, name)
    if config.kubernetes.yaml:
        try:
            write_private(config.kubernetes.yaml, manifests.dumps_yaml([secret, keys, service, pod]))  # 0600
        except OSError as err:
            raise ConfigError(f"--yaml {config.kubernetes.yaml!r} cannot be written: {err}") from None
        job.yaml = config.kubernetes.yaml
        print(f"wrote the master's Secrets, Service and Pod to {config.kubernetes.yaml} (mode 0600: it holds "
              f"the job's token, its key and --envs values); submit them with "
              f"`kubectl apply -f {config.kubernetes.yaml}`", file=sys.stderr)
        return job
    client = client or K8sClient(config.kubernetes.namespace)
    created = client.create_pod(pod)
    owner = manifests.owner_reference(created)
    try:
        for obj, create in ((secret, client.create_secret), (keys, client.create_secret),
                            (service, client.create_service)):
            obj["metadata"]["ownerReferences"] = [owner]
            create(obj)
    except K8sError:
        client.delete_pod(name, 0)  # no half-submitted job
        raise
    print(f"submitted job {config.job.job_name}: pod {name} in namespace {config.kubernetes.namespace} "
          f"(follow it with `kubectl logs -f {name} -n {config.kubernetes.namespace}`)", file=sys.stderr)
    if config.kubernetes.detach:
        return job
    try:
        job.report = follow(client, name)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on in the cluster. Stop it with "
              f"`kubectl delete pod {name} -n {config.kubernetes.namespace}`", file=sys.stderr)
        raise SystemExit(130) from None
    return job


def wait_until_started(client: K8sClient, name: str, poll: float = 0.5) -> dict:
    """The master pod once its container runs (or has ended); raises on what never starts."""
    started, warned = time.monotonic(), False
    while True:
        pod = client.get_pod(name)
        if pod is None:
            raise K8sClusterError(f"the master pod {name} was deleted before it started")
        v = view(pod)
        if v.phase in ("Running", "Succeeded", "Failed"):
            return pod
        if v.waiting_reason in FATAL_WAITING:
            client.delete_pod(name, 0)
            raise K8sContainerError(
                f"the master pod {name} {FATAL_WAITING[v.waiting_reason]} ({v.waiting_reason}: {v.message}). "
                "Check --image_name (built and pushed with `elasticdl zoo build` and `elasticdl zoo push`?), "
                "--image_pull_policy, and that the cluster can reach the registry. The job was deleted."
            )
        waited = time.monotonic() - started
        if v.unschedulable and not warned and waited >= PENDING_WARNING_SECONDS:
            warned = True
            print(f"the master pod {name} has been Pending for {waited:.0f}s: the scheduler says "
                  f"{v.unschedulable!r}. Lower --master_resource_request or free capacity.", file=sys.stderr)
        time.sleep(poll)


def follow(client: K8sClient, name: str) -> dict:
    """Stream the master's log to stderr until it ends; its report, or MasterRefusedError
    (the master exited with code 2: the input is wrong) or JobFailedError."""
    from elasticdl.launch.kubernetes.manifests import REPORT_MARKER

    wait_until_started(client, name)
    report: dict = {}
    tail: list[str] = []
    try:
        for line in client.follow_log(name):
            if line.startswith(REPORT_MARKER):
                report = json.loads(line[len(REPORT_MARKER):])
                continue
            tail = (tail + [line])[-30:]
            print(line, file=sys.stderr, flush=True)
    except K8sError as err:
        logger.warning("lost the master's log (%s); waiting for it to end", err)
    deadline = time.monotonic() + 60
    while True:
        pod = client.get_pod(name)
        v = view(pod) if pod else None
        if v is None or v.phase in ("Succeeded", "Failed") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if v is not None and v.phase == "Succeeded":
        if not report:
            log = client.pod_log(name, tail_lines=5)
            for line in log.splitlines():
                if line.startswith(REPORT_MARKER):
                    report = json.loads(line[len(REPORT_MARKER):])
        return report
    what = "was deleted" if v is None else f"ended {v.phase} (exit code {v.exit_code}, {v.reason or 'no reason'})"
    lines = "\n".join("    " + line for line in tail[-12:])
    if v is not None and v.exit_code == EXIT_USER_ERROR:
        raise MasterRefusedError(f"the master pod {name} refused the job (exit code 2); its last lines:\n{lines}")
    raise JobFailedError(f"the master pod {name} {what}; its last lines:\n{lines}")
