"""Every manifest ElasticDL generates is valid for a current Kubernetes (kubernetes-validate),
and the Kubernetes flags parse into what the issue asks, or fail with a message naming the flag."""

from __future__ import annotations

import os

import kubernetes_validate
import pytest
import yaml

from elasticdl.config import ConfigError, JobConfig
from elasticdl.config import kubernetes as options
from elasticdl.launch.kubernetes import manifests
from elasticdl.launch.kubernetes.backend import LAUNCH_COMMAND, inline_file_args
from elasticdl.launch.kubernetes.client import K8sConfigError, load_api_client
from elasticdl.launch.kubernetes.manifests import ClusterSpec, JobNames, PodPlan
from elasticdl.launch.kubernetes.submit import build_master_objects, submit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S_VERSION = kubernetes_validate.latest_version()


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def k8s_config(**overrides) -> JobConfig:
    flags = dict(
        model_zoo="/model_zoo", model_def="digits.digits_functional.custom_model", training_data="/data/train",
        backend="kubernetes", image_name="registry.example.com/me/digits:v1", job_name="digits-1",
        namespace="ml", num_workers=3,
    )
    return JobConfig.from_flags(**{**flags, **overrides}).with_defaults()


FULL = dict(
    worker_resource_request="cpu=2,memory=4096Mi,gpu=1", worker_resource_limit="cpu=4,memory=8Gi,gpu=1",
    ps_resource_request="cpu=1,memory=2Gi", master_pod_priority="high", ps_pod_priority="my-class",
    worker_pod_priority="0.5", volume="claim_name=data,mount_path=/data;host_path=/mnt/ckpt,mount_path=/ckpt,read_only=true",
    envs="A=1,LOG_DIR=/ckpt/logs", image_pull_policy="IfNotPresent",
)


def worker_pod(config: JobConfig, index: int = 0, priority: str | None = "high") -> dict:
    plan = PodPlan("worker", index, LAUNCH_COMMAND, ["elasticdl.worker.main", "--worker_id", str(index)],
                   owner={"apiVersion": "v1", "kind": "Pod", "name": "elasticdl-digits-1-master", "uid": "u-1"})
    return manifests.pod_manifest(config, plan, manifests.role_spec(config, "worker", priority))


def test_master_objects_are_valid_and_wired_together():
    config = k8s_config(**FULL)
    secret, service, pod = build_master_objects(config, "train", "tok")
    for obj in (secret, service, pod):
        validate(obj)
    assert pod["metadata"]["name"] == "elasticdl-digits-1-master"
    assert pod["metadata"]["namespace"] == "ml"
    assert pod["metadata"]["labels"] == {
        "app": "elasticdl", "elasticdl-job-name": "digits-1",
        "elasticdl-replica-type": "master", "elasticdl-replica-index": "0",
    }
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["serviceAccountName"] == "elasticdl"
    assert spec["priorityClassName"] == "elasticdl-high"
    container = spec["containers"][0]
    assert container["command"] == ["python", "-m", "elasticdl.cli.master_pod"]
    assert container["args"] == ["--command", "train"]
    env = {e["name"]: e for e in container["env"]}
    # The master gets the job's config with each --envs name but not its value (in the Secret).
    assert JobConfig.from_json(env[manifests.JOB_CONFIG_ENV]["value"]) == config.replace(envs="A=,LOG_DIR=")
    assert env[manifests.POD_IP_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["A"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "env.A"}
    assert container["resources"] == {"requests": {"cpu": "0.1", "memory": "1024Mi"},
                                      "limits": {"cpu": "0.1", "memory": "1024Mi"}}
    # The service selects exactly the master pod, on the port the master serves.
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["containerPort"]
    # The token Secret is mounted where ELASTICDL_TOKEN_FILE points.
    assert secret["stringData"] == {"token": "tok", "env.A": "1", "env.LOG_DIR": "/ckpt/logs"}
    volume = next(v for v in spec["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert env["ELASTICDL_TOKEN_FILE"]["value"] == mount["mountPath"] + "/token"


def test_worker_and_ps_pods_are_valid_owned_and_never_restarted():
    config = k8s_config(**FULL)
    pod = worker_pod(config, 2)
    validate(pod)
    assert pod["metadata"]["name"] == "elasticdl-digits-1-worker-2"
    assert pod["metadata"]["labels"]["elasticdl-replica-index"] == "2"
    assert pod["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "elasticdl-digits-1-master", "uid": "u-1"}
    ]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False  # workers never call the API
    assert "serviceAccountName" not in spec
    container = spec["containers"][0]
    assert container["image"] == "registry.example.com/me/digits:v1"
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "4096Mi", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"},
    }
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["volume-0"] == {"name": "volume-0", "persistentVolumeClaim": {"claimName": "data"}}
    assert volumes["volume-1"] == {"name": "volume-1", "hostPath": {"path": "/mnt/ckpt"}}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/ckpt"]["readOnly"] is True and "readOnly" not in mounts["/data"]

    ps_plan = PodPlan("ps", 0, LAUNCH_COMMAND, ["elasticdl.ps.main"], port=manifests.PS_PORT)
    ps = manifests.pod_manifest(config, ps_plan, manifests.role_spec(config, "ps"))
    validate(ps)
    assert ps["spec"]["priorityClassName"] == "my-class"  # a class name is used as it is
    assert ps["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["port"] == manifests.PS_PORT
    service = manifests.service_manifest(config, "ps", 0, manifests.PS_PORT, None)
    validate(service)
    assert service["metadata"]["name"] == "elasticdl-digits-1-ps-0"
    assert service["spec"]["selector"].items() <= ps["metadata"]["labels"].items()


def test_worker_priority_fraction_and_classes():
    from elasticdl.launch.kubernetes.backend import KubernetesBackend

    backend = KubernetesBackend.__new__(KubernetesBackend)
    backend.config = k8s_config(worker_pod_priority="0.5", num_workers=3)
    assert [backend._priority("worker", i, None) for i in range(4)] == ["high", "high", "low", "low"]
    assert backend._priority("worker", 0, "low") == "low"  # the job loop's word wins
    assert worker_pod(backend.config, 0, "low")["spec"]["priorityClassName"] == "elasticdl-low"
    assert "priorityClassName" not in worker_pod(k8s_config(), 0, "")["spec"]


def test_job_names():
    names = JobNames("elasticdl-digits-20240101-120000")
    assert names.pod("master") == "elasticdl-digits-20240101-120000-master"  # no doubled prefix
    assert JobNames("j").pod("ps", 3) == "elasticdl-j-ps-3"
    assert JobNames("j").selector("worker") == "app=elasticdl,elasticdl-job-name=j,elasticdl-replica-type=worker"


def test_deploy_manifest_is_valid_and_grants_what_the_master_uses():
    with open(os.path.join(REPO, "dockerfiles", "deploy.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        validate(doc)
    kinds = {d["kind"]: d for d in docs if d["kind"] != "PriorityClass"}
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding"}
    assert kinds["ServiceAccount"]["metadata"]["name"] == manifests.SERVICE_ACCOUNT
    rules = kinds["Role"]["rules"]
    assert all(rule["apiGroups"] == [""] for rule in rules)
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    # Exactly what the master does (docs/kubernetes.md says why each): nothing more.
    assert granted == {
        *(("pods", verb) for verb in ("create", "get", "list", "watch", "delete")),
        ("pods/log", "get"),
        *(("services", verb) for verb in ("create", "get", "delete")),
    }
    classes = {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}
    assert classes == set(options.PRIORITY_CLASSES.values())


def test_yaml_writes_the_master_manifests_instead_of_submitting(tmp_path):
    out = tmp_path / "job.yaml"
    job = submit(k8s_config(yaml=str(out), **FULL), "train", client=object())  # no cluster is touched
    assert job.yaml == str(out)
    docs = list(yaml.safe_load_all(out.read_text()))
    assert [d["kind"] for d in docs] == ["Secret", "Secret", "Service", "Pod"]  # the token's, the keys'
    for doc in docs:
        validate(doc)


def test_cluster_spec_patches_every_pod_and_service(tmp_path):
    spec_file = tmp_path / "cluster.py"
    spec_file.write_text(
        "def with_pod(pod):\n"
        "    pod['spec']['nodeSelector'] = {'pool': 'gpu'}\n"
        "    return pod\n"
        "class _Cluster:\n"
        "    def with_service(self, service):\n"
        "        service['metadata'].setdefault('annotations', {})['team'] = 'ml'\n"
        "cluster = _Cluster()\n"
    )
    secret, service, pod = build_master_objects(k8s_config(cluster_spec=str(spec_file)), "train", "t")
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert service["metadata"]["annotations"] == {"team": "ml"}
    # The master gets the hook's source, to patch the PS and worker pods it creates.
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    hook = ClusterSpec(env[manifests.CLUSTER_SPEC_ENV])
    assert hook.with_pod(worker_pod(k8s_config()))["spec"]["nodeSelector"] == {"pool": "gpu"}
    validate(pod)

    with pytest.raises(ConfigError, match="cannot be read"):
        build_master_objects(k8s_config(cluster_spec=str(tmp_path / "missing.py")), "train", "t")


def test_resource_strings():
    assert options.parse_resources("cpu=1,memory=4096Mi,gpu=1", "--f") == {
        "cpu": "1", "memory": "4096Mi", "nvidia.com/gpu": "1"}
    assert options.parse_resources(" cpu = 500m , ephemeral-storage=1Gi ", "--f") == {
        "cpu": "500m", "ephemeral-storage": "1Gi"}
    assert options.parse_resources("", "--f") == {}
    for bad, words in [("cpu=one", "'one' for cpu"), ("cpu", "cannot parse 'cpu'"), ("memory=4GB", "quantity"),
                       ("cpu=1,cpu=2", "given twice"), ("cpu=1;memory=2Gi", "quantity")]:
        with pytest.raises(options.OptionError) as err:
            options.parse_resources(bad, "--worker_resource_request")
        assert "--worker_resource_request" in str(err.value) and words in str(err.value), str(err.value)


def test_a_resource_string_that_does_not_parse_fails_validation_naming_the_flag():
    with pytest.raises(ConfigError, match=r"--ps_resource_limit: 'lots' for memory .* is not a Kubernetes quantity"):
        k8s_config(ps_resource_limit="memory=lots").validate("train", check_paths=False)


def test_volumes_and_envs():
    assert options.parse_volumes("claim_name=c,mount_path=/data") == [options.Volume("/data", claim_name="c")]
    for bad in ("mount_path=/data", "claim_name=c", "claim_name=c,host_path=/x,mount_path=/d",
                "claim_name=c,mount_path=data", "size=1,mount_path=/d",
                "claim_name=a,mount_path=/d;claim_name=b,mount_path=/d"):
        with pytest.raises(options.OptionError, match="--volume"):
            options.parse_volumes(bad)
    assert options.parse_envs("A=1,B=x=y") == {"A": "1", "B": "x=y"}
    with pytest.raises(options.OptionError, match="--envs"):
        options.parse_envs("1A=2")


@pytest.mark.parametrize("overrides,words", [
    ({"image_name": ""}, "--image_name"),
    ({"job_name": "Digits_1"}, "--job_name"),
    ({"job_name": "j" * 60}, "--job_name"),
    ({"image_pull_policy": "Sometimes"}, "--image_pull_policy"),
    ({"namespace": "ML"}, "--namespace"),
    ({"volume": "mount_path=/x"}, "--volume"),
    ({"cluster_spec": "spec.txt"}, "--cluster_spec"),
])
def test_kubernetes_flag_errors(overrides, words):
    with pytest.raises(ConfigError, match=words):
        k8s_config(**overrides).validate("train", check_paths=False)


def test_client_does_not_check_paths_that_live_in_the_image():
    k8s_config().validate("train", check_paths=False)  # /model_zoo exists only in the image
    with pytest.raises(ConfigError, match="--model_zoo"):
        k8s_config().validate("train")


def test_file_arguments_travel_in_the_environment(tmp_path):
    config_file = tmp_path / "job_config.json"
    config_file.write_text('{"a": 1}')
    args, env = inline_file_args(["--job_config", str(config_file), "--ps_id", "0"])
    assert args == ["--job_config", "env:ELASTICDL_ARG_FILE_JOB_CONFIG", "--ps_id", "0"]
    assert env == {"ELASTICDL_ARG_FILE_JOB_CONFIG": '{"a": 1}'}

    from elasticdl.launch.kubernetes.pod_entry import materialize

    os.environ.update(env)
    try:
        out = materialize(args, str(tmp_path))
    finally:
        del os.environ["ELASTICDL_ARG_FILE_JOB_CONFIG"]
    assert open(out[1]).read() == '{"a": 1}' and out[2:] == ["--ps_id", "0"]


def test_no_kubeconfig_and_not_in_a_cluster_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope"))
    with pytest.raises(K8sConfigError, match="not running in a pod .* no kubeconfig"):
        load_api_client()
