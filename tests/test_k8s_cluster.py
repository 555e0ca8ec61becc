"""The fake cluster behaves like a real one where ElasticDL depends on it, and the
Kubernetes backend, watch loop and client submission work against it (real client)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import pytest
from k8s_fake.harness import FakeCluster

from elasticdl.config import JobConfig
from elasticdl.launch.api import RoleExitedError
from elasticdl.launch.kubernetes import manifests
from elasticdl.launch.kubernetes.backend import KubernetesBackend
from elasticdl.launch.kubernetes.client import (
    K8sConflict,
    K8sError,
    K8sForbidden,
    K8sGone,
    K8sInvalid,
    K8sNotFound,
)
from elasticdl.launch.kubernetes.pod_state import PodTable
from elasticdl.launch.kubernetes.submit import submit
from elasticdl.launch.kubernetes.watch import PodWatchLoop
from elasticdl.rpc import auth as security
from elasticdl.rpc import trust

PY = sys.executable


def pod(name: str, code: str = "import time; time.sleep(60)", labels=None, grace: int = 30, **container) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": "t"}},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace,
                 "containers": [{"name": "main", "image": "python", "command": ["python", "-c", code],
                                 **container}]},
    }


def wait(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def cluster(tmp_path):
    with FakeCluster(tmp_path, namespaces=("default",), unpullable={"missing/image:v1"}) as c:
        yield c


# ------------------------------------------------------------------ API fidelity


def test_the_api_refuses_what_a_real_server_refuses(cluster):
    client = cluster.client()
    client.create_pod(pod("p"))
    with pytest.raises(K8sConflict, match='pods "p" already exists'):
        client.create_pod(pod("p"))
    with pytest.raises(K8sNotFound, match="namespace 'nowhere' does not exist"):
        cluster.client("nowhere").create_pod(pod("p"))
    assert client.get_pod("absent") is None
    with pytest.raises(K8sInvalid, match="metadata.name"):
        client.create_pod(pod("Bad_Name"))
    with pytest.raises(K8sInvalid, match="must be less than or equal to cpu limit"):
        client.create_pod(pod("q", resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}))
    with pytest.raises(K8sInvalid, match="containers"):  # the OpenAPI schema: a list, not a string
        client.create_pod({**pod("r"), "spec": {"containers": "main"}})


def test_label_selectors(cluster):
    client = cluster.client()
    for name, labels in [("a", {"role": "ps", "i": "0"}), ("b", {"role": "worker", "i": "0"}), ("c", {"role": "worker"})]:
        client.create_pod(pod(name, labels=labels))
    names = lambda sel: sorted(p["metadata"]["name"] for p in client.list_pods(sel)[0])  # noqa: E731
    assert names("role=worker") == ["b", "c"]
    assert names("role!=worker") == ["a"]
    assert names("role in (ps,worker),i") == ["a", "b"]
    assert names("!i") == ["c"]


def test_watch_from_a_resource_version_and_410_once_compacted(cluster):
    client = cluster.client()
    _, version = client.list_pods("app=t")
    client.create_pod(pod("w"))
    events = client.watch_pods("app=t", version, timeout_seconds=1)
    kind, obj = next(events)
    assert (kind, obj["metadata"]["name"]) == ("ADDED", "w")
    events.close()
    cluster.api.store.compact()
    with pytest.raises(K8sGone):
        list(client.watch_pods("app=t", version, timeout_seconds=1))


def test_the_watch_loop_relists_after_410_and_errors_and_misses_nothing(cluster):
    client = cluster.client()
    table = PodTable()
    client.create_pod(pod("x", labels={"app": "t", "elasticdl-replica-type": "worker", "elasticdl-replica-index": "0"}))
    loop = PodWatchLoop(client, "app=t", table.on_event, timeout_seconds=1, max_backoff=0.2)
    loop.start()
    try:
        wait(lambda: table.alive("worker") == [0], what="the first list")
        cluster.api.fail_next(500, 503)  # the API hiccups on the next two lists or watches
        cluster.api.expire_watches()  # and the open watch ends with 410 Gone
        client.delete_pod("x", 0)  # meanwhile
        wait(lambda: table.alive("worker") == [], what="the deletion to be seen")
        assert [e.reason for e in table.drain_exits()] == ["Deleted"]
        assert loop.relists >= 2
    finally:
        loop.stop()


def test_rbac_forbidden_says_which_verb_on_which_resource(cluster):
    cluster.api.forbid("admin", "create", "services")
    with pytest.raises(K8sForbidden) as err:
        cluster.client().create_service(manifests.service_manifest(_config(), "ps", 0, 2222, None))
    assert "`create` on `services`" in str(err.value)
    assert "cannot create resource" in str(err.value)  # the server's own words
    assert "dockerfiles/deploy.yaml" in str(err.value)


def test_delete_is_sigterm_then_sigkill_after_the_grace_period(cluster):
    client = cluster.client()
    client.create_pod(pod("stubborn", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('up', flush=True); time.sleep(60)", grace=1))
    client.create_pod(pod("polite", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
                                    "print('up', flush=True); time.sleep(60)"))
    for name in ("stubborn", "polite"):
        wait(lambda name=name: "up" in _log(cluster, name), what=f"{name} to run")
    _, version = client.list_pods("app=t")
    started = time.monotonic()
    client.delete_pod("stubborn")
    client.delete_pod("polite")
    wait(lambda: client.get_pod("polite") is None, what="polite to go")
    assert time.monotonic() - started < 1.0  # it left on SIGTERM, well within its 30 s
    wait(lambda: client.get_pod("stubborn") is None, what="stubborn to be killed")
    assert time.monotonic() - started >= 1.0  # SIGKILL only after its 1 s grace period
    finals = {o["metadata"]["name"]: o for k, o in client.watch_pods("app=t", version, 1) if k == "DELETED"}
    code = lambda n: finals[n]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]  # noqa: E731
    assert (code("polite"), code("stubborn")) == (0, 137)


def test_deleting_an_owner_deletes_its_dependents(cluster):
    client = cluster.client()
    owner = client.create_pod(pod("owner"))
    dependent = pod("dependent")
    dependent["metadata"]["ownerReferences"] = [manifests.owner_reference(owner)]
    client.create_pod(dependent)
    client.delete_pod("owner", 0)
    wait(lambda: client.get_pod("dependent") is None, what="garbage collection")


def _log(cluster, name: str, ns: str = "default") -> str:
    path = cluster.api.log_paths.get((ns, name))
    return open(path).read() if path else ""


# ------------------------------------------------------------------ the backend


def _config(**overrides) -> JobConfig:
    flags = dict(model_zoo="/zoo", model_def="a.b.c", training_data="/d", backend="kubernetes",
                 image_name="elasticdl:test", job_name="unit", num_workers=2,
                 ps_resource_request="cpu=0.1,memory=64Mi", worker_resource_request="cpu=0.1,memory=64Mi")
    return JobConfig.from_flags(**{**flags, **overrides}).with_defaults()


@pytest.fixture
def backend_env(cluster, tmp_path, monkeypatch):
    """The job's token and keys Secrets, the same token and key for this test process, and role files."""
    token = security.new_token()
    config = _config()
    client = cluster.client()
    client.create_secret(manifests.secret_manifest(config, token, None))
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)  # a token file every user may read is refused
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(token_file))
    # The job key: a Secret of its own for the PS pods, and a file for this test process, the master.
    client.create_secret(manifests.keys_secret_manifest(config, "the-job-key", None))
    key_file = tmp_path / "job-key"
    key_file.write_text("the-job-key")
    key_file.chmod(0o600)
    monkeypatch.setenv(trust.JOB_KEY_FILE_ENV, str(key_file))
    config_file, optimizer_file = tmp_path / "job_config.json", tmp_path / "optimizer.json"
    config_file.write_text(config.to_json())
    optimizer_file.write_text(json.dumps({"name": "SGD", "config": {"learning_rate": 0.1}}))
    ps_args = ["--job_config", str(config_file), "--optimizer_spec", str(optimizer_file), "--ps_id", "0"]
    backend = KubernetesBackend(config, client, watch_timeout_seconds=2, pending_warning_seconds=0.5)
    yield backend, ps_args
    backend.stop_all(2)


def test_a_ps_pod_serves_behind_its_service_and_keeps_its_address_when_relaunched(cluster, backend_env):
    import numpy as np

    from elasticdl.rpc.ps_client import PSClient

    backend, ps_args = backend_env
    backend.start("ps", 0, ps_args)
    [address] = backend.ps_addresses(1, 30)
    assert address.endswith(":2222") and address.split(":")[0] == cluster.api.store.get(
        "services", "default", "elasticdl-unit-ps-0")["spec"]["clusterIP"]
    params = {"w": np.ones((2, 2), np.float32)}
    client = PSClient([address])  # through the simulated kube-proxy, with the job token
    assert client.push_model(params) == [True]
    client.close()

    cluster.client().delete_pod("elasticdl-unit-ps-0", 1)  # preempted
    exits = wait(backend.poll_exits, what="the PS exit")
    assert [(e.role, e.index, e.reason) for e in exits] == [("ps", 0, "Deleted")]
    assert backend.running("ps") == []

    backend.start("ps", 0, ps_args)  # relaunched under the same name
    assert backend.ps_addresses(1, 30) == [address]
    client = PSClient([address])
    assert client.pull([-1])[0].initialized is False  # a fresh PS (restoring is the job loop's call)
    client.close()

    backend.stop_all(2)
    assert cluster.pods(selector="elasticdl-job-name=unit") == []
    assert cluster.api.store.list("services", "default")[0] == []


def test_a_ps_that_fails_to_start_is_reported_with_its_log(cluster, backend_env):
    backend, ps_args = backend_env
    backend.start("ps", 0, [*ps_args, "--no_such_flag"])
    with pytest.raises(RoleExitedError) as err:
        backend.ps_addresses(1, 30)
    assert err.value.exit.returncode == 2 and err.value.exit.reason == "Error"
    assert "unrecognized arguments: --no_such_flag" in err.value.exit.log_tail


def test_an_image_that_cannot_be_pulled_is_an_exit_with_a_clear_reason(cluster, backend_env, caplog):
    backend, _ = backend_env
    backend.config.kubernetes.image_name = "missing/image:v1"
    backend.start("worker", 0, ["--worker_id", "0"])
    exits = wait(backend.poll_exits, what="the image pull failure")
    assert exits[0].reason in ("ErrImagePull", "ImagePullBackOff") and exits[0].returncode == 1
    assert "pull access denied" in exits[0].log_tail
    assert "Check --image_name missing/image:v1" in caplog.text
    wait(lambda: cluster.client().get_pod("elasticdl-unit-worker-0") is None, what="the stuck pod's deletion")


def test_a_pod_that_cannot_be_scheduled_is_reported(tmp_path, caplog, monkeypatch):
    key_file = tmp_path / "job-key"  # the master's: it mints the worker's credential
    key_file.write_text("k")
    key_file.chmod(0o600)
    monkeypatch.setenv(trust.JOB_KEY_FILE_ENV, str(key_file))
    with FakeCluster(tmp_path, capacity=0) as cluster:
        backend = KubernetesBackend(_config(), cluster.client(), watch_timeout_seconds=2,
                                    pending_warning_seconds=0.3)
        try:
            with caplog.at_level(logging.WARNING):
                backend.start("worker", 0, ["--worker_id", "0"])
                wait(lambda: (backend.poll_exits(), "has been Pending" in caplog.text)[1], timeout=60,
                     what="the warning")  # an event; the whole suite's load once held it past 15 s
            assert "Too many pods" in caplog.text  # the scheduler's words
            assert backend.running("worker") == [0]  # still wanted: it starts when there is room
        finally:
            backend.stop_all(1)


# ------------------------------------------------------------------ the client


def test_submitting_to_a_missing_namespace_or_without_rights_fails_clearly(cluster, tmp_path):
    result = _cli(cluster, tmp_path, "--namespace", "nowhere")
    assert result.returncode == 2
    assert "namespace 'nowhere' does not exist" in result.stderr

    cluster.api.forbid("admin", "create", "secrets")
    with pytest.raises(K8sForbidden, match="`create` on `secrets`"):
        submit(_config(job_name="forbidden"), "train", client=cluster.client())
    assert cluster.client().get_pod("elasticdl-forbidden-master") is None  # no half-submitted job


def test_a_master_image_that_cannot_be_pulled_fails_the_submission(cluster):
    with pytest.raises(K8sError, match="cannot pull its image .* The job was deleted"):
        submit(_config(image_name="missing/image:v1", job_name="nopull"), "train", client=cluster.client())
    wait(lambda: cluster.client().get_pod("elasticdl-nopull-master") is None, what="the master's deletion")


def _cli(cluster, cwd, *flags):
    import subprocess

    return subprocess.run(
        [PY, "-m", "elasticdl", "train", "--backend", "kubernetes", "--image_name", "elasticdl:test",
         "--model_zoo", "/model_zoo", "--model_def", "a.b.c", "--training_data", "/data", *flags],
        cwd=cwd, env=cluster.env(), capture_output=True, text=True, timeout=60,
    )


def test_detach_returns_once_submitted(cluster, tmp_path):
    result = _cli(cluster, tmp_path, "--job_name", "detached", "--detach")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["master_pod"] == "elasticdl-detached-master"
    assert cluster.client().get_pod("elasticdl-detached-master") is not None
    assert os.environ.get("KUBECONFIG") != cluster.kubeconfig  # the test process was not touched


def test_the_job_key_reaches_ps_pods_only_and_each_worker_pod_its_own_credential(cluster, backend_env):
    """The keys Secret is mounted in PS (and master) pods; a worker pod gets its credential, not the key."""
    backend, ps_args = backend_env
    backend.start("ps", 0, ps_args)
    backend.start("worker", 1, ["--job_config", ps_args[1], "--worker_id", "1"])
    ps = cluster.api.store.get("pods", "default", "elasticdl-unit-ps-0")["spec"]
    worker = cluster.api.store.get("pods", "default", "elasticdl-unit-worker-1")["spec"]

    def secrets(spec):
        return {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}

    def env(spec):
        return {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}

    assert secrets(ps) == {"elasticdl-unit-token", "elasticdl-unit-keys"}
    assert env(ps)[trust.JOB_KEY_FILE_ENV] == f"{manifests.KEYS_MOUNT}/{trust.JOB_KEY_FILE_NAME}"
    assert secrets(worker) == {"elasticdl-unit-token"} and trust.JOB_KEY_FILE_ENV not in env(worker)
    assert env(worker)[trust.WORKER_CREDENTIAL_ENV] == trust.worker_credential("the-job-key", 1)
    master = manifests.master_pod_manifest(_config(), "train")["spec"]
    assert secrets(master) == {"elasticdl-unit-token", "elasticdl-unit-keys"}
