"""The Kubernetes backend: every PS and worker is a pod the in-cluster master creates and watches.

- Pods are named ``elasticdl-<job>-ps-<i>`` / ``-worker-<i>``, labelled with the job, role and
  index, owned by the master pod (deleting the master deletes the job), restartPolicy Never.
- Each PS has a ClusterIP service; workers reach it at the service's address, so a PS
  relaunched under the same name keeps its address.
- A watch thread (list-then-watch, reconnect on 410) feeds a ``PodTable``; the job loop
  polls exits as it does with local processes. Exit codes follow ``subprocess``
  (``137`` → ``-9``); ``ProcessExit.reason`` says Deleted, Evicted, OOMKilled, ImagePullBackOff...
- Files the local backend passes by path (``--job_config``) travel in the pod's
  environment; ``elasticdl.launch.kubernetes.pod_entry`` writes them back to files in the pod.
  The job config goes without the values of ``--envs`` (pods read them from the job's Secret).
- The job's token is the mounted Secret's (``Backend.token``); every pod mounts it.
"""

from __future__ import annotations

import logging
import math
import os
import time

import grpc

from elasticdl.config import JobConfig
from elasticdl.launch.api import Backend, BackendError, ProcessExit, RoleExitedError
from elasticdl.launch.kubernetes import manifests
from elasticdl.launch.kubernetes.client import K8sClient, K8sConflict, K8sError
from elasticdl.launch.kubernetes.manifests import MASTER_PORT, PS_PORT, ClusterSpec, JobNames, PodPlan
from elasticdl.launch.kubernetes.pod_state import PodPhase, PodTable
from elasticdl.launch.kubernetes.watch import PodWatchLoop
from elasticdl.rpc import trust

logger = logging.getLogger(__name__)

MODULES = {"ps": "elasticdl.ps.main", "worker": "elasticdl.worker.main"}
FILE_FLAGS = ("--job_config", "--optimizer_spec")
FILE_ENV_PREFIX = "ELASTICDL_ARG_FILE_"
LAUNCH_COMMAND = ["python", "-m", "elasticdl.launch.kubernetes.pod_entry"]
DELETE_WAIT = 60.0


def file_env_name(flag: str) -> str:
    return FILE_ENV_PREFIX + flag.lstrip("-").upper()


def inline_file_args(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``--job_config /master/path`` → ``--job_config env:ELASTICDL_ARG_FILE_JOB_CONFIG`` + that env."""
    out, env = list(args), {}
    for i, arg in enumerate(out[:-1]):
        if arg in FILE_FLAGS:
            name = file_env_name(arg)
            with open(out[i + 1], encoding="utf-8") as f:
                env[name] = f.read()
            out[i + 1] = f"env:{name}"
    return out, env


class KubernetesBackend(Backend):
    def __init__(
        self,
        config: JobConfig,
        client: K8sClient,
        owner: dict | None = None,
        cluster_spec: ClusterSpec | None = None,
        pod_ip: str = "",
        pending_warning_seconds: float = 60.0,
        watch_timeout_seconds: int = 30,
    ):
        self.config = config
        self.client = client
        self.owner = owner
        self.cluster_spec = cluster_spec or ClusterSpec()
        self.pod_ip = pod_ip or os.environ.get(manifests.POD_IP_ENV, "")
        self.names = JobNames(config.job.job_name)
        self.table = PodTable(pending_warning_seconds)
        self._service_addresses: dict[int, str] = {}  # PS index -> cluster IP:port
        self._held_exits: list[ProcessExit] = []
        self._watch = PodWatchLoop(client, self.names.selector(), self.table.on_event, watch_timeout_seconds)
        self._watching = False

    # ------------------------------------------------------------ helpers

    def _ensure_watching(self) -> None:
        if not self._watching:
            self._watch.start()
            self._watching = True
            if not self._watch.synced.wait(30):
                logger.warning("the first pod list did not come back within 30s; still trying")

    def _priority(self, role: str, index: int, priority: str | None) -> str | None:
        if role != "worker" or priority is not None:
            return priority
        from elasticdl.config.priority import high_count

        # The job loop normally says; otherwise the first ceil(f*n) indices are high.
        elasticity = self.config.elasticity
        return "high" if index < high_count(elasticity.worker_pod_priority, elasticity.num_workers) else "low"

    def _create(self, body: dict, role: str, index: int) -> dict:
        body = self.cluster_spec.with_pod(body)
        name = body["metadata"]["name"]
        try:
            created = self.client.create_pod(body)
        except K8sConflict:
            # A leftover of an earlier attempt with this name: replace it.
            logger.info("%s exists already; deleting it first", name)
            self._delete_and_wait(name, 0)
            created = self.client.create_pod(body)
        self.table.expect(name, role, index, created["metadata"].get("uid", ""))
        return created

    def _delete_and_wait(self, name: str, grace: int | None, timeout: float = DELETE_WAIT) -> None:
        if not self.client.delete_pod(name, grace):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.client.get_pod(name) is None:
                return
            time.sleep(0.1)
        raise BackendError(f"pod {name} was not deleted within {timeout:.0f}s")

    def _ensure_ps_service(self, index: int) -> str:
        if index in self._service_addresses:
            return self._service_addresses[index]
        body = self.cluster_spec.with_service(
            manifests.service_manifest(self.config, "ps", index, PS_PORT, self.owner)
        )
        try:
            service = self.client.create_service(body)
        except K8sConflict:
            service = self.client.get_service(body["metadata"]["name"]) or {}
        ip = (service.get("spec") or {}).get("clusterIP", "")
        if not ip or ip == "None":
            raise BackendError(f"service {body['metadata']['name']} has no cluster IP")
        self._service_addresses[index] = f"{ip}:{PS_PORT}"
        return self._service_addresses[index]

    def _log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return self.client.pod_log(name, tail_lines=lines)
        except K8sError as err:
            return f"(no log: {err})\n"

    def _to_exit(self, pod_exit) -> ProcessExit:
        level = logging.INFO if pod_exit.returncode == 0 or pod_exit.reason == "Deleted" else logging.WARNING
        logger.log(level, "pod %s ended: %s (exit code %d)%s", pod_exit.name, pod_exit.reason,
                   pod_exit.returncode, f": {pod_exit.message}" if pod_exit.message else "")
        tail = self._log_tail(pod_exit.name)
        if pod_exit.message:
            tail += f"[{pod_exit.reason}] {pod_exit.message}\n"
        if pod_exit.reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                               "CreateContainerConfigError"):
            logger.error(
                "%s cannot start: %s %s. Check --image_name %s (pushed? `elasticdl zoo push`), "
                "--image_pull_policy and the cluster's access to the registry.",
                pod_exit.name, pod_exit.reason, pod_exit.message, self.config.kubernetes.image_name,
            )
            self.client.delete_pod(pod_exit.name, 0)  # it would wait forever
        return ProcessExit(pod_exit.role, pod_exit.index, pod_exit.returncode, tail, pod_exit.reason)

    def _drain(self) -> list[ProcessExit]:
        self.table.check_pending()
        for warning in self.table.drain_warnings():
            logger.warning("%s", warning)
        return [self._to_exit(e) for e in self.table.drain_exits()]

    # ------------------------------------------------------------ Backend

    def bind_master(self, server: grpc.Server) -> str:
        if not self.pod_ip:
            raise BackendError(f"the in-cluster master needs its pod IP in ${manifests.POD_IP_ENV}")
        if server.add_insecure_port(f"{self.pod_ip}:{MASTER_PORT}") == 0:
            raise BackendError(f"cannot bind {self.pod_ip}:{MASTER_PORT}")
        service = self.client.get_service(self.names.service("master"))
        ip = ((service or {}).get("spec") or {}).get("clusterIP", "")
        if ip and ip != "None":
            return f"{ip}:{MASTER_PORT}"
        logger.warning("no service %s: workers reach the master at its pod IP", self.names.service("master"))
        return f"{self.pod_ip}:{MASTER_PORT}"

    def start(self, role: str, index: int, args: list[str], env: dict[str, str] | None = None,
              priority: str | None = None) -> None:
        self._ensure_watching()
        name = self.names.pod(role, index)
        record = self.table.get(name)
        if record is not None and record.state in (PodPhase.PENDING, PodPhase.RUNNING):
            raise BackendError(f"{name} is still running; stop it before starting it again")
        if record is not None and record.state is PodPhase.EXITED:
            self._delete_and_wait(name, 0)  # a relaunch under the same name (PS)
        pod_args, file_env = inline_file_args(args)
        config_env = file_env_name("--job_config")
        if config_env in file_env:  # --envs values reach pods from the job's Secret, never in their config
            file_env[config_env] = manifests.without_secret_values(JobConfig.from_json(file_env[config_env])).to_json()
        if role == "worker":  # its own credential, minted here; never the job key (rpc/trust.py)
            file_env[trust.WORKER_CREDENTIAL_ENV] = trust.worker_credential(self.job_key(), index)
        port = None
        if role == "ps":
            self._ensure_ps_service(index)
            pod_args += ["--port", str(PS_PORT)]
            port = PS_PORT
        plan = PodPlan(
            role=role, index=index, command=LAUNCH_COMMAND, args=[MODULES[role], *pod_args],
            env={**file_env, **(env or {})}, port=port, owner=self.owner,
        )
        spec = manifests.role_spec(self.config, role, self._priority(role, index, priority))
        self._create(manifests.pod_manifest(self.config, plan, spec), role, index)
        logger.debug("created pod %s", name)

    def running(self, role: str) -> list[int]:
        return self.table.alive(role)

    def poll_exits(self) -> list[ProcessExit]:
        held, self._held_exits = self._held_exits, []
        return held + self._drain()

    def request_stop(self, role: str, index: int, grace: float = 30.0) -> None:
        self.client.delete_pod(self.names.pod(role, index), max(1, math.ceil(grace)))

    def stop(self, role: str, index: int, timeout: float = 10.0) -> None:
        name = self.names.pod(role, index)
        self.client.delete_pod(name, max(1, math.ceil(timeout)))
        self.table.wait_for(lambda records: name not in records or records[name].state is PodPhase.GONE,
                            timeout + 10)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Workers first, then PS; then the PS services. The master pod stays (its log, its exit code)."""
        try:
            for role in ("worker", "ps"):
                names = [n for n, r in list(self.table.records.items())
                         if r.role == role and r.state is not PodPhase.GONE]
                for name in names:
                    self.client.delete_pod(name, max(1, math.ceil(timeout)))
                self.table.wait_for(
                    lambda records, names=names: all(records[n].state is PodPhase.GONE for n in names),
                    timeout + 10,
                )
            for index in list(self._service_addresses):
                self.client.delete_service(self.names.service("ps", index))
            self._service_addresses.clear()
        finally:
            self._watch.stop()
            self._watching = False

    def ps_addresses(self, num_ps: int, timeout: float) -> list[str]:
        names = [self.names.pod("ps", i) for i in range(num_ps)]
        deadline = time.monotonic() + timeout
        while True:
            for exit_ in self._drain():
                if exit_.role == "ps":
                    raise RoleExitedError(exit_)
                self._held_exits.append(exit_)
            if all((r := self.table.get(n)) is not None and r.ready for n in names):
                return [self._ensure_ps_service(i) for i in range(num_ps)]
            if time.monotonic() > deadline:
                states = ", ".join(f"{n}: {getattr(self.table.get(n), 'state', 'unknown')}" for n in names)
                raise TimeoutError(f"parameter servers were not ready within {timeout:.0f}s ({states})")
            self.table.wait_for(lambda records: False, 0.2)
