"""End to end on the fake cluster: `elasticdl train --backend kubernetes` through the real client.

The client submits the master pod; the master (a pod, in its own process) creates the PS
and worker pods through the fake API server; the simulated kubelet runs them as local
processes on their own 127.x addresses; workers reach the master and the PS through their
services (the simulated kube-proxy). See tests/k8s_fake/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from k8s_fake.harness import FakeCluster, deploy_role_rules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    subprocess.run(
        [sys.executable, os.path.join(MODEL_ZOO, "digits", "prepare_data.py"), "--output", str(out)],
        check=True, capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # The master's service account may do only what the Role of dockerfiles/deploy.yaml grants.
    with FakeCluster(tmp_path_factory.mktemp("cluster"), master_rules=deploy_role_rules()) as c:
        yield c


def k8s_train_args(digits, job_name: str, **flags) -> list[str]:
    args = [
        sys.executable, "-m", "elasticdl", "train", "--backend", "kubernetes", "--image_name", "elasticdl:test",
        "--image_pull_policy", "IfNotPresent", "--job_name", job_name,
        "--model_zoo", MODEL_ZOO, "--model_def", "digits.digits_functional.custom_model",
        "--training_data", str(digits / "train"), "--validation_data", str(digits / "test"),
        "--minibatch_size", "32", "--num_epochs", "3", "--num_workers", "2", "--num_ps", "1",
        "--worker_resource_request", "cpu=0.5,memory=512Mi", "--ps_resource_request", "cpu=0.5,memory=512Mi",
    ]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args


def report_of(stdout: str, stderr: str, returncode: int) -> dict:
    assert returncode == 0, stderr[-5000:]
    return json.loads(stdout[stdout.index("{"):])


def job_pods(cluster, job: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in cluster.pods(selector=f"elasticdl-job-name={job}")}


def wait_for_cleanup(cluster, job: str, timeout: float = 20) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = job_pods(cluster, job)
        if set(pods) == {f"elasticdl-{job}-master"}:
            return pods
        time.sleep(0.2)
    return job_pods(cluster, job)


def test_digits_job_on_kubernetes_reaches_accuracy(cluster, digits, tmp_path):
    result = subprocess.run(
        k8s_train_args(digits, "digits-k8s"), cwd=tmp_path, env=cluster.env(),
        capture_output=True, text=True, timeout=240,
    )
    report = report_of(result.stdout, result.stderr, result.returncode)
    assert report["metrics"]["accuracy"] >= 0.90
    assert report["records_trained"] == 3 * 1437
    assert "submitted job digits-k8s" in result.stderr  # the client followed the master's log
    assert "parameter servers at" in result.stderr

    # Every role ran as a pod: master, 1 PS (with its service), 2 workers, owned by the master.
    started = [n for n in cluster.kubelet.started if n.startswith("elasticdl-digits-k8s-")]
    assert sorted(started) == [
        "elasticdl-digits-k8s-master", "elasticdl-digits-k8s-ps-0",
        "elasticdl-digits-k8s-worker-0", "elasticdl-digits-k8s-worker-1",
    ]
    # When the job ends, PS and worker pods are deleted; the master pod stays with its exit status.
    pods = wait_for_cleanup(cluster, "digits-k8s")
    assert list(pods) == ["elasticdl-digits-k8s-master"]
    assert pods["elasticdl-digits-k8s-master"]["status"]["phase"] == "Succeeded"
    created_ps = [obj for _, r, _, kind, obj in cluster.api.store.events
                  if r == "pods" and kind == "ADDED" and obj["metadata"]["name"] == "elasticdl-digits-k8s-ps-0"]
    owner = created_ps[0]["metadata"]["ownerReferences"][0]
    assert owner["name"] == "elasticdl-digits-k8s-master" and owner["kind"] == "Pod"
    assert created_ps[0]["spec"]["restartPolicy"] == "Never"
    # PS and workers call no Kubernetes API: the master's service account is the only one.
    users = {user for user, _, _ in cluster.api.requests}
    assert users == {"admin", cluster.master_user, "system:node:fake-node"}

    # Deleting the master deletes what it owns (token Secret, services), as the GC does.
    cluster.client().delete_pod("elasticdl-digits-k8s-master", 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        name.startswith("elasticdl-digits-k8s") for (_, _, name) in list(cluster.api.store.objects)
    ):
        time.sleep(0.1)
    assert not [k for k in cluster.api.store.objects if k[2].startswith("elasticdl-digits-k8s")]


def test_deleting_a_worker_pod_mid_job_is_a_preemption(cluster, digits, tmp_path):
    job = "digits-preempt"
    # Ten epochs (about 7 s of training): three were over in 2 s, and the master saw the
    # deleted pod end after the job did, which is no preemption (nothing left to refill).
    client = subprocess.Popen(
        k8s_train_args(digits, job, num_epochs=10), cwd=tmp_path, env=cluster.env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # Once worker-1 trains (it pushed a gradient), delete its pod: a preemption.
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            log = cluster.api.log_paths.get(("default", f"elasticdl-{job}-worker-1"))
            if log and "first gradient pushed" in open(log).read():
                break
            assert client.poll() is None, client.stderr.read()
            time.sleep(0.2)
        else:
            pytest.fail("worker-1 never trained")
        assert cluster.client().delete_pod(f"elasticdl-{job}-worker-1")  # default grace: SIGTERM, then SIGKILL
        stdout, stderr = client.communicate(timeout=200)
    finally:
        if client.poll() is None:
            client.kill()
    report = report_of(stdout, stderr, client.returncode)
    assert report["metrics"]["accuracy"] >= 0.90
    assert report["records_trained"] >= 10 * 1437  # every record of every epoch at least once
    assert report["dropped_tasks"] == 0
    assert f"pod elasticdl-{job}-worker-1 ended: Deleted" in stderr  # the master saw the deletion
    assert report["worker_preemptions"] == 1  # a scale-down, not a failure: its slot was refilled
    assert f"elasticdl-{job}-worker-2" in cluster.kubelet.started
    assert list(wait_for_cleanup(cluster, job)) == [f"elasticdl-{job}-master"]


def test_worker_pods_preprocess_with_the_master_pods_adapted_state(cluster, tmp_path):
    """Pods share no directory with the master: each worker pod asks the master for its adapted
    FeatureSpace (get_preprocessing_state) and must log the digest the master handed out."""
    import re

    from test_e2e_preprocessing_state import ZOO, _write_data

    _write_data(tmp_path / "train")
    job = "adapt-k8s"
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--backend", "kubernetes", "--image_name", "elasticdl:test",
         "--image_pull_policy", "IfNotPresent", "--job_name", job, "--model_zoo", ZOO,
         "--model_def", "adaptzoo.feature_space_pid.custom_model", "--training_data", str(tmp_path / "train"),
         "--minibatch_size", "32", "--num_epochs", "1", "--num_workers", "2", "--num_ps", "1",
         "--worker_resource_request", "cpu=0.5,memory=512Mi", "--ps_resource_request", "cpu=0.5,memory=512Mi"],
        cwd=tmp_path, env=cluster.env(), capture_output=True, text=True, timeout=300,
    )
    report_of(result.stdout, result.stderr, result.returncode)
    (sent,) = re.findall(r"preprocessing state (\w+) \(\d+ layers\) handed to the workers", result.stderr)
    taken = {}
    for worker in (0, 1):
        with open(cluster.api.log_paths[("default", f"elasticdl-{job}-worker-{worker}")]) as f:
            taken[worker] = re.findall(r"preprocessing state (\w+) \(\d+ layers\) from the master", f.read())
    assert taken == {0: [sent], 1: [sent]}, (sent, taken)
