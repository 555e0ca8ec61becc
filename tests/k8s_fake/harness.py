"""``FakeCluster``: the fake API server, a simulated kubelet and kube-proxy, and a kubeconfig.

    with FakeCluster(tmp_path) as cluster:
        client = cluster.client()                       # elasticdl's K8sClient, real kubernetes client
        env = cluster.env()                             # KUBECONFIG for `elasticdl ... --backend kubernetes`

Pods run as local processes with the harness's Python first on PATH; each gets its own
127.100.x.y address, each service its own 127.200.x.y (random second octets per cluster,
so parallel clusters do not collide).
"""

from __future__ import annotations

import os
import random
import sys

import yaml

from k8s_fake.apiserver import FakeApiServer
from k8s_fake.kubelet import SimulatedKubelet
from k8s_fake.proxy import ServiceProxy

ADMIN_TOKEN = "admin-token"
KUBELET_TOKEN = "kubelet-token"
MASTER_TOKEN = "master-sa-token"
MASTER_USER = "system:serviceaccount:{ns}:elasticdl"
DEPLOY_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "dockerfiles", "deploy.yaml")


def deploy_role_rules(path: str = DEPLOY_YAML) -> list[dict]:
    """The rules of the master's Role in dockerfiles/deploy.yaml."""
    with open(path) as f:
        [role] = [d for d in yaml.safe_load_all(f) if d and d["kind"] == "Role"]
    return role["rules"]


def write_kubeconfig(path: str, server: str, token: str) -> str:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake-user", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake-user"}}],
    }
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


class FakeCluster:
    def __init__(self, base_dir, namespaces=("default",), capacity: int = 32, unpullable=(),
                 extra_env: dict[str, str] | None = None, master_rules: list[dict] | None = None):
        """``master_rules``: the master's service account may do only what these RBAC rules
        grant (e.g. ``deploy_role_rules()``); by default it may do anything."""
        self.base_dir = str(base_dir)
        octet = random.randint(0, 120)
        self.master_user = MASTER_USER.format(ns=namespaces[0] if namespaces else "default")
        self.api = FakeApiServer(
            {ADMIN_TOKEN: "admin", KUBELET_TOKEN: "system:node:fake-node", MASTER_TOKEN: self.master_user},
            service_subnet=f"127.{130 + octet}",
        )
        if master_rules is not None:
            self.api.grant_only(self.master_user, master_rules)
        for ns in namespaces:
            self.api.create_namespace(ns)
        self.kubeconfig = write_kubeconfig(os.path.join(self.base_dir, "kubeconfig"), self.api.url, ADMIN_TOKEN)
        self.master_kubeconfig = write_kubeconfig(
            os.path.join(self.base_dir, "master-kubeconfig"), self.api.url, MASTER_TOKEN
        )
        bin_dir = os.path.dirname(sys.executable)
        base_env = {
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"),
            "LANG": "C.UTF-8",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # Pods import the code under test, not another install's (a worktree on PYTHONPATH).
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
            **(extra_env or {}),
        }
        self.capacity = capacity
        self.unpullable = set(unpullable)
        self._base_env = base_env
        self.kubelet: SimulatedKubelet | None = None
        self.proxy: ServiceProxy | None = None

    def __enter__(self) -> FakeCluster:
        self.api.start()
        from elasticdl.launch.kubernetes.client import load_api_client

        kubelet_config = write_kubeconfig(os.path.join(self.base_dir, "kubelet-kubeconfig"), self.api.url,
                                          KUBELET_TOKEN)
        self.kubelet = SimulatedKubelet(
            load_api_client(kubelet_config), os.path.join(self.base_dir, "node"),
            pod_subnet=f"127.{10 + random.randint(0, 110)}", capacity=self.capacity, base_env=self._base_env,
            # A pod with a service account gets API access, as a real kubelet mounts its token.
            api_env={"KUBECONFIG": self.master_kubeconfig}, log_paths=self.api.log_paths,
            unpullable=self.unpullable,
        ).start()
        self.proxy = ServiceProxy(self.api.store).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.proxy is not None:
            self.proxy.stop()
        self.api.stop()

    def client(self, namespace: str = "default", kubeconfig: str = ""):
        from elasticdl.launch.kubernetes.client import K8sClient, load_api_client

        return K8sClient(namespace, load_api_client(kubeconfig or self.kubeconfig))

    def env(self) -> dict[str, str]:
        """The environment for an ``elasticdl`` client process talking to this cluster."""
        env = dict(os.environ, KUBECONFIG=self.kubeconfig)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        return env

    def pods(self, namespace: str = "default", selector: str = "") -> list[dict]:
        return self.api.store.list("pods", namespace, selector)[0]
