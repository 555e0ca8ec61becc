"""End to end: a token holder attacks a running digits job (real processes, real gRPC).

Issue 25 found that one finite 1e38 gradient turned the model into noise (accuracy 0.10)
while the job reported success, and that a forged push of a task to its end made the real
pushes of that task "already taken". Here a caller holding the job's token (but not the job
key) does both while the job trains; the job must end as if nothing happened, and its
report must name the refusal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

from elasticdl.rpc.batch_position import BatchPosition
from elasticdl.rpc.push_outcome import PushOutcome
from tests.test_e2e_elastic import _wait_for
from tests.test_e2e_local import MODEL_ZOO, digits  # noqa: F401  (digits: the prepared data, a fixture)


def _ps_address(log: str) -> str | None:
    if not os.path.exists(log):
        return None
    found = re.search(r"parameter servers at (\S+)", open(log).read())
    return found.group(1).rstrip(",") if found else None


def test_a_token_holder_can_neither_wreck_the_model_nor_forge_the_evidence(digits, tmp_path, monkeypatch):  # noqa: F811
    data = digits
    job = subprocess.Popen(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO,
         "--model_def", "digits.digits_functional.custom_model", "--training_data", str(data / "train"),
         "--validation_data", str(data / "test"), "--minibatch_size", "32", "--num_epochs", "4",
         "--num_workers", "1", "--num_ps", "1", "--use_async", "--job_name", "attacked"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        run_dir = tmp_path / "runs" / "attacked"
        address = _wait_for(lambda: _ps_address(str(run_dir / "logs" / "master.log")), 120, "the PS address")
        _wait_for(lambda: (run_dir / "token").exists(), 30, "the job's token")
        monkeypatch.setenv("ELASTICDL_TOKEN_FILE", str(run_dir / "token"))  # the token, not the job key
        from elasticdl.rpc.ps_client import PSClient

        client = PSClient([address])
        pulled = _wait_for(lambda: (lambda p: p if p.initialized else None)(client.pull([-1])[0]), 120, "the model")
        huge = {name: np.full_like(value, 1e38) for name, value in pulled.params.items()}
        wrecking = client.push_gradients({0: huge}, [pulled.version], 0.0, 0)[0]
        assert wrecking.outcome is PushOutcome.REJECTED_INVALID and "float32" in wrecking.reason
        small = {name: np.zeros_like(value) for name, value in pulled.params.items()}
        for task_id in range(3):  # "task t trained to record 10**6": the real pushes would be dropped
            forged = client.push_gradients({0: small}, [pulled.version], 0.0, 0,
                                           batch=BatchPosition(task_id, 1, 10**6, 10**6, b"forged"))[0]
            assert forged.outcome is PushOutcome.REJECTED_INVALID and "does not verify" in forged.reason
        client.close()
        out, err = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err[-4000:]
    report = json.loads(out[out.index("{"):])
    assert report["gradients_refused"] == 1 and report["staleness"]["gradients_refused"] == 1
    assert "refused 1 gradients" in err  # the warning
    assert report["exactly_once"]["holds"] and report["records_trained"] == 4 * 1437
    assert report["metrics"]["accuracy"] >= 0.85  # the model was not wrecked (0.10 before)
