"""--ps_replicas on Kubernetes (the fake cluster, tests/k8s_fake/): PS pods forward to their
backups on the neighbouring pods, on each pod's own IP; a deleted PS pod's shard goes on from its
backup and the pod is relaunched under the same name and service as a spare (docs/replicas.md)."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.test_k8s_e2e import cluster, digits, k8s_train_args, report_of, wait_for_cleanup  # noqa: F401  fixtures


def test_a_deleted_ps_pod_with_replicas_fails_over_to_its_backup_with_nothing_rolled_back(cluster, digits, tmp_path):  # noqa: F811
    job = "digits-replicas"
    client = subprocess.Popen(
        k8s_train_args(digits, job, num_epochs=6, num_ps=2, ps_replicas=1, num_workers=1), cwd=tmp_path,
        env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            log = cluster.api.log_paths.get(("default", f"elasticdl-{job}-worker-0"))
            if log and "first gradient pushed" in open(log).read():
                break
            assert client.poll() is None, client.stderr.read()[-5000:]
            time.sleep(0.2)  # a poll of another process's log with a deadline, not a wait for time to pass
        else:
            pytest.fail("worker-0 never trained")
        assert cluster.client().delete_pod(f"elasticdl-{job}-ps-1", 0)  # its process SIGKILLed
        stdout, stderr = client.communicate(timeout=300)
    finally:
        if client.poll() is None:
            client.kill()
    report = report_of(stdout, stderr, client.returncode)
    assert report["ps_rollbacks"] == [], report["ps_rollbacks"]
    assert [(f["shard"], f["old_primary"], f["new_primary"]) for f in report["ps_failovers"]] == [(1, 1, 0)]
    assert report["exactly_once"]["holds"], report["exactly_once"]
    assert report["records_possibly_missing"] == 0
    assert sum(sum(v for k, v in e.items() if k != "epoch") for e in report["records_retrained"]) == 0
    assert "shard 1 goes on from its backup on PS 0" in stderr
    assert "PS 1 caught up and backs up shards [0, 1] again" in stderr  # the new pod, not its predecessor
    assert cluster.kubelet.started.count(f"elasticdl-{job}-ps-1") == 2  # relaunched as a spare, same name
    assert list(wait_for_cleanup(cluster, job)) == [f"elasticdl-{job}-master"]
