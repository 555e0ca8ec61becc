"""A simulated kubelet (and scheduler) for the fake API server.

It watches pods through the real ``kubernetes`` client, binds them to its node while it
has room (else marks them Unschedulable), and runs each container's command as a local
process: the pod's env (downward API fields, secret keys, values), its own loopback
address (127.x.y.z as status.podIP), its secret volumes written to a per-pod directory.
A volume's mountPath in an env value or argument is rewritten to that local directory
(there is no mount namespace here). It reports phases back through the API (Pending →
Running → Succeeded/Failed, readiness from the pod's tcpSocket probe) and, when a pod is
deleted, sends SIGTERM, then SIGKILL after the grace period, and removes the object.

An image named in ``unpullable`` never starts: ErrImagePull, then ImagePullBackOff.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

NODE = "fake-node"


@dataclass
class _Container:
    name: str
    ns: str
    uid: str
    workdir: str
    pod_ip: str = ""
    popen: subprocess.Popen | None = None
    probe_port: int | None = None
    ready: bool = False
    started_at: str = ""
    term_sent_at: float | None = None
    killed: bool = False
    reported_exit: bool = False
    waiting: str = ""
    log: object = None
    extra: dict = field(default_factory=dict)


class SimulatedKubelet:
    def __init__(self, api_client, base_dir: str, pod_subnet: str = "127.100", capacity: int = 32,
                 base_env: dict[str, str] | None = None, api_env: dict[str, str] | None = None,
                 log_paths: dict | None = None, unpullable: set[str] | None = None, poll: float = 0.1):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.base_dir = base_dir
        self.pod_subnet = pod_subnet
        self.capacity = capacity
        self.base_env = base_env or {}
        self.api_env = api_env or {}  # what a pod with a service account token gets (the kubeconfig)
        self.log_paths = log_paths if log_paths is not None else {}
        self.unpullable = unpullable or set()
        self.poll = poll
        self.containers: dict[tuple[str, str], _Container] = {}  # (ns, name) of the running pod object
        self.started: list[str] = []  # pod names, in start order (for tests)
        self._next_ip = 2
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._unschedulable_told: set[str] = set()

    def start(self) -> SimulatedKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for c in self.containers.values():
            if c.popen is not None and c.popen.poll() is None:
                _signal_group(c.popen, signal.SIGKILL)
                c.popen.wait(5)

    def pod_process(self, ns: str, name: str) -> subprocess.Popen | None:
        c = self.containers.get((ns, name))
        return c.popen if c else None

    # -------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as err:  # the API may be stopping; try again
                if not self._stop.is_set():
                    print(f"fake kubelet: {type(err).__name__}: {err}", flush=True)
            self._stop.wait(self.poll)

    def _sync(self) -> None:
        resp = self.core.list_pod_for_all_namespaces(_preload_content=False)
        pods = json.loads(resp.data)["items"]
        bound = sum(1 for p in pods if p["spec"].get("nodeName") == NODE
                    and p["status"].get("phase") not in ("Succeeded", "Failed"))
        seen = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            key = (meta["namespace"], meta["name"])
            seen.add(key)
            if not spec.get("nodeName"):
                if meta.get("deletionTimestamp"):
                    continue
                if bound < self.capacity:
                    self._bind(pod)
                    bound += 1
                else:
                    self._unschedulable(pod)
                continue
            if spec["nodeName"] != NODE:
                continue
            container = self.containers.get(key)
            if container is not None and container.uid != meta["uid"]:
                # An older pod of the same name, force-deleted and replaced between two syncs: its
                # process goes, as a kubelet kills the containers of a pod no longer in the API.
                # Left running, a relaunched PS's predecessor kept answering (--ps_replicas: the
                # master's catch-up reached it, not the new pod, and the job hung).
                self.containers.pop(key)
                if container.popen is not None and container.popen.poll() is None:
                    _signal_group(container.popen, signal.SIGKILL)
                container = None
            if meta.get("deletionTimestamp"):
                self._terminate(pod, container)
            elif container is None or container.popen is None:
                self._start(pod, container)
            else:
                self._observe(pod, container)
        for key in [k for k in self.containers if k not in seen]:
            c = self.containers.pop(key)
            if c.popen is not None and c.popen.poll() is None:
                _signal_group(c.popen, signal.SIGKILL)

    def _patch_status(self, pod: dict, status: dict) -> None:
        meta = pod["metadata"]
        _read(self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status},
                                                    _preload_content=False))

    def _bind(self, pod: dict) -> None:
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}}
        _read(self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], body, _preload_content=False))

    def _unschedulable(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self._unschedulable_told:
            return
        self._unschedulable_told.add(uid)
        self._patch_status(pod, {"conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": f"0/1 nodes are available: 1 Too many pods (capacity {self.capacity}).",
        }]})

    # -------------------------------------------------------------- start

    def _start(self, pod: dict, container: _Container | None) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        key = (meta["namespace"], meta["name"])
        c_spec = spec["containers"][0]
        if container is None:
            workdir = os.path.join(self.base_dir, meta["namespace"], f"{meta['name']}-{meta['uid'][:8]}")
            os.makedirs(workdir, exist_ok=True)
            container = self.containers[key] = _Container(meta["name"], meta["namespace"], meta["uid"], workdir)
        if c_spec["image"] in self.unpullable:
            reason = "ErrImagePull" if container.waiting != "ErrImagePull" else "ImagePullBackOff"
            if container.waiting != reason:
                container.waiting = reason
                self._patch_status(pod, {"containerStatuses": [_status(c_spec["name"], c_spec["image"], {
                    "waiting": {"reason": reason, "message": f'failed to pull image "{c_spec["image"]}": '
                                "pull access denied, repository does not exist or may require authorization"}
                })]})
            return
        mounts = self._prepare_volumes(pod, container)
        if mounts is None:
            if container.waiting != "ContainerCreating":
                container.waiting = "ContainerCreating"
                self._patch_status(pod, {"containerStatuses": [_status(
                    c_spec["name"], c_spec["image"], {"waiting": {"reason": "ContainerCreating"}})]})
            return  # a secret it mounts does not exist yet: the real kubelet retries too
        container.pod_ip = container.pod_ip or self._allocate_ip()
        env = dict(self.base_env)
        if spec.get("automountServiceAccountToken", True) is not False:
            env.update(self.api_env)
        for item in c_spec.get("env") or []:
            value = self._env_value(pod, container, item)
            if value is not None:
                env[item["name"]] = _rewrite(value, mounts)
        argv = [_rewrite(a, mounts) for a in (c_spec.get("command") or []) + (c_spec.get("args") or [])]
        log_path = os.path.join(container.workdir, "container.log")
        container.log = open(log_path, "ab")
        self.log_paths[key] = log_path
        try:
            container.popen = subprocess.Popen(
                argv, env=env, cwd=c_spec.get("workingDir") or container.workdir, stdin=subprocess.DEVNULL,
                stdout=container.log, stderr=subprocess.STDOUT, start_new_session=True,
                # No preexec_fn (it once set PR_SET_PDEATHSIG): Python code between fork and exec, in
                # a test process where librdkafka's threads run (the Kafka tests), crashed every pod
                # with SIGSEGV (exit 139). The cluster's teardown kills the pods it started.
            )
        except OSError as err:
            container.log.write(f"exec failed: {err}\n".encode())
            container.log.flush()
            self._patch_status(pod, {"phase": "Failed", "containerStatuses": [_status(
                c_spec["name"], c_spec["image"], {"terminated": {"exitCode": 128, "reason": "StartError",
                                                                 "message": str(err)}})]})
            container.reported_exit = True
            return
        self.started.append(meta["name"])
        probe = (c_spec.get("readinessProbe") or {}).get("tcpSocket")
        container.probe_port = int(probe["port"]) if probe else None
        container.ready = probe is None
        container.started_at = _now()
        self._patch_status(pod, {
            "phase": "Running", "podIP": container.pod_ip, "podIPs": [{"ip": container.pod_ip}],
            "hostIP": "127.0.0.1", "startTime": container.started_at,
            "conditions": _conditions(container.ready),
            "containerStatuses": [_status(c_spec["name"], c_spec["image"],
                                          {"running": {"startedAt": container.started_at}}, container.ready)],
        })

    def _allocate_ip(self) -> str:
        n = self._next_ip
        self._next_ip += 1
        return f"{self.pod_subnet}.{n // 250}.{n % 250 + 2}"

    def _prepare_volumes(self, pod: dict, container: _Container) -> dict[str, str] | None:
        """mountPath -> local directory; None while a secret is missing."""
        meta, spec = pod["metadata"], pod["spec"]
        local: dict[str, str] = {}
        for volume in spec.get("volumes") or []:
            path = os.path.join(container.workdir, "volumes", volume["name"])
            if "secret" in volume:
                try:
                    resp = self.core.read_namespaced_secret(volume["secret"]["secretName"], meta["namespace"],
                                                            _preload_content=False)
                except Exception:
                    return None
                secret = json.loads(resp.data)
                os.makedirs(path, exist_ok=True)
                for k, v in (secret.get("data") or {}).items():
                    file = os.path.join(path, k)
                    with open(file, "wb") as f:
                        f.write(base64.b64decode(v))
                    os.chmod(file, volume["secret"].get("defaultMode", 0o644))
            elif "hostPath" in volume:
                path = volume["hostPath"]["path"]
            else:  # emptyDir, persistentVolumeClaim: a directory of the node
                claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
                if claim:
                    path = os.path.join(self.base_dir, "claims", claim)
                os.makedirs(path, exist_ok=True)
            local[volume["name"]] = path
        mounts = {}
        for m in spec["containers"][0].get("volumeMounts") or []:
            target = local[m["name"]]
            mounts[m["mountPath"]] = os.path.join(target, m["subPath"]) if m.get("subPath") else target
        return mounts

    def _env_value(self, pod: dict, container: _Container, item: dict) -> str | None:
        if "value" in item:
            return item["value"]
        source = item.get("valueFrom") or {}
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {
                "metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
                "metadata.uid": pod["metadata"]["uid"], "status.podIP": container.pod_ip,
                "spec.nodeName": NODE, "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                "status.hostIP": "127.0.0.1",
            }
            return fields.get(path, "")
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            resp = self.core.read_namespaced_secret(ref["name"], pod["metadata"]["namespace"], _preload_content=False)
            data = json.loads(resp.data).get("data") or {}
            return base64.b64decode(data[ref["key"]]).decode()
        return None

    # -------------------------------------------------------------- running and ending

    def _observe(self, pod: dict, c: _Container) -> None:
        if c.reported_exit:
            return
        code = c.popen.poll()
        if code is not None:
            self._report_exit(pod, c, code)
            return
        if c.probe_port is not None:
            ready = _tcp_ok(c.pod_ip, c.probe_port)
            if ready != c.ready:
                c.ready = ready
                c_spec = pod["spec"]["containers"][0]
                self._patch_status(pod, {"conditions": _conditions(ready), "containerStatuses": [_status(
                    c_spec["name"], c_spec["image"], {"running": {"startedAt": c.started_at}}, ready)]})

    def _report_exit(self, pod: dict, c: _Container, code: int) -> None:
        c.reported_exit = True
        if c.log is not None:
            c.log.flush()
        exit_code = 128 - code if code < 0 else code  # -9 -> 137, as a container runtime reports
        c_spec = pod["spec"]["containers"][0]
        reason = "Completed" if exit_code == 0 else "Error"
        self._patch_status(pod, {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": _conditions(False),
            "containerStatuses": [_status(c_spec["name"], c_spec["image"], {"terminated": {
                "exitCode": exit_code, "reason": reason, "startedAt": c.started_at, "finishedAt": _now()}})],
        })

    def _terminate(self, pod: dict, c: _Container | None) -> None:
        meta = pod["metadata"]
        if c is not None and c.popen is not None and c.popen.poll() is None:
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            if c.term_sent_at is None:
                c.term_sent_at = time.monotonic()
                _signal_group(c.popen, signal.SIGTERM)
            if time.monotonic() - c.term_sent_at >= grace and not c.killed:
                c.killed = True
                _signal_group(c.popen, signal.SIGKILL)
            return  # still going: look again on the next pass
        if c is not None and c.popen is not None and not c.reported_exit:
            self._report_exit(pod, c, c.popen.returncode)
        try:
            _read(self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body={"gracePeriodSeconds": 0},
                                                  _preload_content=False))
        except Exception:
            pass
        key = (meta["namespace"], meta["name"])
        self.containers.pop(key, None)
        if c is not None:
            shutil.rmtree(os.path.join(c.workdir, "volumes"), ignore_errors=True)  # secrets do not linger


def _read(resp) -> bytes:
    """Read the whole answer: the pooled connection is reused for the next request."""
    return resp.data


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


def _rewrite(text: str, mounts: dict[str, str]) -> str:
    for mount_path in sorted(mounts, key=len, reverse=True):
        if text == mount_path or text.startswith(mount_path.rstrip("/") + "/"):
            return mounts[mount_path] + text[len(mount_path):]
    return text


def _tcp_ok(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _conditions(ready: bool) -> list[dict]:
    value = "True" if ready else "False"
    return [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": value}, {"type": "Ready", "status": value}]


def _status(name: str, image: str, state: dict, ready: bool = False) -> dict:
    return {"name": name, "image": image, "imageID": "", "ready": ready, "restartCount": 0, "state": state,
            "started": "running" in state}
