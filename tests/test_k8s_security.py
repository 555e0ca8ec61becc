"""Per-job token auth and the cluster's side of security.

- Every gRPC call must carry the job's token: servers and channels come from
  elasticdl.rpc.channel, as in the roles; the token comes from the file
  $ELASTICDL_TOKEN_FILE names (the mounted Secret in a pod). No server starts without one.
- --envs values live in the job's Secret, read through secretKeyRef; no pod spec and no job
  config handed to a pod holds them. --yaml is written 0600.
- Every pod meets the Pod Security Standard "restricted"; the images run as non-root.
- The master's Role (dockerfiles/deploy.yaml) is enough for the backend, and no more.

Local mode, with real processes: tests/test_local_security.py.
"""

from __future__ import annotations

import os
import stat

import grpc
import numpy as np
import pytest

from elasticdl.model.optimizers import OptimizerSpec, make_optimizer
from elasticdl.proto import elasticdl_pb2_grpc
from elasticdl.ps.server import ParameterServer, PSSettings
from elasticdl.ps.servicer import PServerServicer
from elasticdl.rpc import auth as security
from elasticdl.rpc import channel as grpc_utils
from elasticdl.rpc.ps_client import PSClient

PARAMS = {"dense/kernel": np.ones((3, 2), np.float32), "dense/bias": np.zeros((2,), np.float32)}
GRADS = {"dense/kernel": np.full((3, 2), 0.5, np.float32), "dense/bias": np.ones((2,), np.float32)}


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text(security.new_token() + "\n")
    path.chmod(0o600)
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(path))
    return path


@pytest.fixture
def ps_server(token_file):
    """A real PS behind a server made while the job token is mounted."""
    core = ParameterServer(PSSettings(), make_optimizer(OptimizerSpec("SGD", {"learning_rate": 0.1})))
    server = grpc_utils.make_server()
    grpc_utils.add_service(server, "PServer", PServerServicer(core))
    port = grpc_utils.bind_local(server)
    server.start()
    yield core, f"127.0.0.1:{port}"
    server.stop(0)


def test_no_server_starts_without_a_token(monkeypatch):
    """Fail closed: the bind address (a pod IP or not) no longer decides whether calls are checked."""
    monkeypatch.delenv(security.TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv(grpc_utils.POD_IP_ENV, "127.0.0.1")  # what once made a PS serve strangers
    assert security.job_token() is None
    with pytest.raises(security.TokenError, match="ELASTICDL_TOKEN_FILE is not set"):
        grpc_utils.make_server()
    with pytest.raises(security.TokenError, match="needs the job's token"):
        security.server_interceptors("")
    assert isinstance(grpc_utils.make_server(token="t"), grpc.Server)  # an explicit token serves


def test_calls_with_the_token_pass(ps_server):
    core, address = ps_server
    client = PSClient([address])  # make_channel adds the token
    assert client.push_model(PARAMS) == [True]
    client.push_gradients({0: GRADS}, [0], 0.1, worker_id=0)
    assert core.shard.version == 1
    client.close()


def test_a_call_without_the_token_is_refused_and_changes_nothing(ps_server, monkeypatch):
    core, address = ps_server
    PSClient([address]).push_model(PARAMS)
    before = {k: v.copy() for k, v in core.shard.params.items()}

    monkeypatch.delenv(security.TOKEN_FILE_ENV)  # a client that does not have the Secret
    intruder = PSClient([address])
    with pytest.raises(grpc.RpcError) as err:
        intruder.push_gradients({0: GRADS}, [0], 0.1, worker_id=0)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        intruder.push_model({k: v + 1 for k, v in PARAMS.items()}, version=7)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        intruder.pull([-1])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    intruder.close()

    assert core.shard.version == 0
    for name, value in before.items():
        np.testing.assert_array_equal(core.shard.params[name], value)


def test_a_wrong_token_is_refused(ps_server, tmp_path, monkeypatch):
    core, address = ps_server
    wrong = tmp_path / "wrong"
    wrong.write_text(security.new_token())
    wrong.chmod(0o600)
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(wrong))
    with pytest.raises(grpc.RpcError) as err:
        PSClient([address]).push_model(PARAMS)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not core.shard.params


def test_the_master_refuses_calls_without_the_token(token_file, monkeypatch):
    from elasticdl.proto import elasticdl_pb2

    class Master(elasticdl_pb2_grpc.MasterServicer):
        calls = 0

        def get_task(self, request, context):
            Master.calls += 1
            return elasticdl_pb2.Task(type=elasticdl_pb2.WAIT)

    server = grpc_utils.make_server()
    elasticdl_pb2_grpc.add_MasterServicer_to_server(Master(), server)
    port = grpc_utils.bind_local(server)
    server.start()
    try:
        with grpc_utils.make_channel(f"127.0.0.1:{port}") as channel:
            elasticdl_pb2_grpc.MasterStub(channel).get_task(elasticdl_pb2.GetTaskRequest(worker_id=0))
        assert Master.calls == 1
        monkeypatch.delenv(security.TOKEN_FILE_ENV)
        with grpc_utils.make_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                elasticdl_pb2_grpc.MasterStub(channel).get_task(elasticdl_pb2.GetTaskRequest(worker_id=0))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert Master.calls == 1  # the servicer never ran
    finally:
        server.stop(0)


def test_an_unreadable_token_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="Secret is not mounted"):
        security.job_token()


@pytest.mark.parametrize("text, mode, words", [
    ("", 0o600, "is empty"),
    ("  \n", 0o400, "is empty"),
    ("tok", 0o644, r"readable by every user \(mode 0644\).*chmod 600"),
])
def test_an_empty_or_world_readable_token_file_is_refused(tmp_path, monkeypatch, text, mode, words):
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(path))
    with pytest.raises(security.TokenError, match=words):
        grpc_utils.make_server()


def test_private_files_are_0600_even_over_a_world_readable_one(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")
    path.chmod(0o644)
    security.write_private(str(path), "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["f"]  # no temporary file left behind


# ---------------------------------------------------------------- secrets, pods, images, the Role

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "s3cr3t-value-9731"  # an --envs value: it must appear in the Secret and nowhere else


def _k8s_config(**overrides):
    from elasticdl.config import JobConfig

    flags = dict(model_zoo="/zoo", model_def="a.b.c", training_data="/d", backend="kubernetes",
                 image_name="elasticdl:test", job_name="sec", num_workers=1, envs=f"API_KEY={SECRET},MODE=fast",
                 ps_resource_request="cpu=0.1,memory=64Mi", worker_resource_request="cpu=0.1,memory=64Mi")
    return JobConfig.from_flags(**{**flags, **overrides}).with_defaults()


def _pods(config):
    """The master pod as the client makes it, and a PS and a worker pod as the master does."""
    from elasticdl.launch.kubernetes import manifests
    from elasticdl.launch.kubernetes.backend import LAUNCH_COMMAND
    from elasticdl.launch.kubernetes.submit import build_master_objects

    secret, _, master = build_master_objects(config, "train", "tok")
    pods = [master]
    for role in ("ps", "worker"):
        plan = manifests.PodPlan(role, 0, LAUNCH_COMMAND, [f"elasticdl.{role}.main"],
                                 owner={"apiVersion": "v1", "kind": "Pod", "name": "m", "uid": "u"})
        pods.append(manifests.pod_manifest(config, plan, manifests.role_spec(config, role)))
    return secret, pods


def test_envs_values_are_in_the_secret_and_pods_read_them_by_reference():
    import json

    config = _k8s_config()
    secret, pods = _pods(config)
    assert secret["stringData"]["env.API_KEY"] == SECRET and secret["immutable"] is True
    for pod in pods:
        assert SECRET not in json.dumps(pod), pod["metadata"]["name"]  # not as a value, not in the config
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert "value" not in env["API_KEY"] and "value" not in env["MODE"]  # every --envs counts as secret
        assert env["API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                               "key": "env.API_KEY"}


def _restricted_violations(pod: dict) -> list[str]:
    """What breaks the Pod Security Standard "restricted" (kubernetes.io/docs/concepts/security/
    pod-security-standards), for the fields ElasticDL's pods use."""
    spec = pod["spec"]
    pod_sc = spec.get("securityContext") or {}
    problems = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
               "projected", "secret"}
    problems += [f"volume {v['name']}" for v in spec.get("volumes") or [] if not set(v) - {"name"} <= allowed]
    for c in spec["containers"]:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append("allowPrivilegeEscalation")
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            problems.append("capabilities.drop")
        if set((sc.get("capabilities") or {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append("capabilities.add")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append("runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append("runAsUser")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append("seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append("hostPort")
    return problems


def test_every_pod_meets_the_restricted_pod_security_standard():
    import kubernetes_validate

    config = _k8s_config(volume="claim_name=data,mount_path=/data")
    _, pods = _pods(config)
    for pod in pods:
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
        assert _restricted_violations(pod) == [], pod["metadata"]["name"]
        sc = pod["spec"]["containers"][0]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        # fsGroup: the token (mode 0400) stays readable by the non-root user
        assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"] != 0
    # A hostPath volume is what "restricted" forbids (docs/kubernetes.md says so).
    _, pods = _pods(_k8s_config(volume="host_path=/mnt,mount_path=/mnt"))
    assert _restricted_violations(pods[0]) == ["volume volume-0"]


def test_the_images_run_as_the_pods_non_root_user():
    from elasticdl.cli import zoo
    from elasticdl.launch.kubernetes.manifests import RUN_AS_USER

    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        with open(os.path.join(REPO, "dockerfiles", name)) as f:
            users = [line.split()[1] for line in f if line.startswith("USER ")]
        assert users[-1] == f"{RUN_AS_USER}:{RUN_AS_USER}", name  # numeric: the kubelet checks runAsNonRoot
    assert zoo.dockerfile("base", True).splitlines()[-1] == f"USER {RUN_AS_USER}:{RUN_AS_USER}"


def test_yaml_is_written_for_the_submitter_only(tmp_path):
    from elasticdl.launch.kubernetes.submit import submit

    out = tmp_path / "job.yaml"
    out.write_text("an older, world-readable file\n")
    out.chmod(0o644)
    submit(_k8s_config(yaml=str(out)), "train", client=object())  # no cluster is touched
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert SECRET in out.read_text()  # the Secret is in it: that is why only its owner may read it
    from elasticdl.config import ConfigError

    with pytest.raises(ConfigError, match="--yaml .* cannot be written"):
        submit(_k8s_config(yaml=str(tmp_path / "no" / "such" / "dir.yaml")), "train", client=object())


def test_the_role_is_enough_for_the_backend_and_no_more(tmp_path, monkeypatch):
    """The backend, as the master's service account limited to the Role of deploy.yaml, starts a
    PS pod (with --envs from the Secret), relaunches it and cleans up; the Role refuses the rest."""
    import json
    import time

    from k8s_fake.harness import FakeCluster, deploy_role_rules

    from elasticdl.launch.kubernetes import manifests
    from elasticdl.launch.kubernetes.backend import KubernetesBackend
    from elasticdl.launch.kubernetes.client import K8sForbidden

    config = _k8s_config()
    token = security.new_token()
    with FakeCluster(tmp_path, master_rules=deploy_role_rules()) as cluster:
        cluster.client().create_secret(manifests.secret_manifest(config, token, None))  # the submitter's
        cluster.client().create_secret(manifests.keys_secret_manifest(config, "the-job-key", None))
        master = cluster.client(kubeconfig=cluster.master_kubeconfig)
        token_file = tmp_path / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        monkeypatch.setenv(security.TOKEN_FILE_ENV, str(token_file))
        config_file, optimizer_file = tmp_path / "job_config.json", tmp_path / "optimizer.json"
        config_file.write_text(config.to_json())  # with the values: the backend must leave them out
        optimizer_file.write_text(json.dumps({"name": "SGD", "config": {"learning_rate": 0.1}}))
        ps_args = ["--job_config", str(config_file), "--optimizer_spec", str(optimizer_file), "--ps_id", "0"]
        backend = KubernetesBackend(config, master, watch_timeout_seconds=2)
        try:
            assert backend.token() == token
            backend.start("ps", 0, ps_args)
            [address] = backend.ps_addresses(1, 30)
            created = cluster.api.store.get("pods", "default", "elasticdl-sec-ps-0")
            assert SECRET not in json.dumps(created)
            # ...yet the PS process has it: the kubelet resolved the secretKeyRef.
            proc = cluster.kubelet.containers[("default", "elasticdl-sec-ps-0")].popen
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                assert f"API_KEY={SECRET}".encode() in f.read().split(b"\0")
            client = PSClient([address])
            assert client.push_model(PARAMS) == [True]
            client.close()
            cluster.client().delete_pod("elasticdl-sec-ps-0", 1)  # preempted: relaunched by the master
            deadline = time.monotonic() + 15
            while not backend.poll_exits():
                assert time.monotonic() < deadline, "the PS exit was never seen"
                time.sleep(0.05)  # polls for the exit with a deadline: cannot race
            backend.start("ps", 0, ps_args)
            assert backend.ps_addresses(1, 30) == [address]
        finally:
            backend.stop_all(2)
        assert cluster.pods(selector="elasticdl-job-name=sec") == []
        asked = {(verb, resource) for user, verb, resource in cluster.api.requests if user == cluster.master_user}
        assert {("create", "pods"), ("delete", "pods"), ("watch", "pods"), ("create", "services"),
                ("delete", "services")} <= asked
        # What the master never needs, the Role refuses.
        with pytest.raises(K8sForbidden, match="secrets"):
            master.create_secret(manifests.secret_manifest(config.replace(job_name="other"), "x", None))
        from kubernetes.client.exceptions import ApiException

        with pytest.raises(ApiException) as err:
            master.core.list_namespaced_service("default")
        assert err.value.status == 403
