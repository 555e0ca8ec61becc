"""End to end on object storage: DeepFM reads Parquet from s3:// (moto's S3 server on loopback),
checkpoints to s3://, survives a PS SIGKILL by restoring from s3://, exports to s3://; the
exported model loads and scores."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np

from tests.test_e2e_elastic import _ps_pids, _wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")
COLUMNS = "f0,f1,f2,f3,f4,f5,f6,f7,tags,label"


def _generate(output: str) -> dict:
    sys.path.insert(0, MODEL_ZOO)
    try:
        from deepctr.generate_parquet import generate
    finally:
        sys.path.remove(MODEL_ZOO)
    return generate(output, train_rows=4_000, test_rows=1_000, train_files=2, row_group_rows=512)


def _ids(table, max_tags: int, pad_id: int) -> np.ndarray:
    """The model's input, as deepfm_parquet.dataset_fn builds it: 8 field ids, then the padded tags."""
    fields = np.stack([table[f"f{f}"].to_numpy() for f in range(8)], axis=1)
    tags = np.full((table.num_rows, max_tags), pad_id, np.int64)
    for row, values in enumerate(table["tags"].to_pylist()):
        tags[row, :len(values)] = values[:max_tags]
    return np.concatenate([fields, tags], axis=1)


def test_deepfm_on_parquet_in_s3_survives_a_ps_kill_and_exports_to_s3(s3_env, tmp_path):
    # Column records (records=columns), tasks of two row groups of 512 rows: each task streams,
    # its second row group read while the first trains.
    bucket = s3_env.new_bucket("ctr")
    root = f"s3://{bucket}"
    meta = _generate(f"{root}/ctr")
    s3 = s3_env.filesystem()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO,
         "--model_def", "deepctr.deepfm_parquet.custom_model", "--training_data", f"{root}/ctr/train",
         "--data_reader_params", f"columns={COLUMNS};records=columns", "--num_workers", "1", "--num_ps", "1",
         "--minibatch_size", "64", "--records_per_task", "1024", "--num_epochs", "1",
         "--checkpoint_dir", f"{root}/ckpt", "--checkpoint_steps", "10", "--output", f"{root}/model",
         "--job_name", "s3-deepfm"],
        cwd=tmp_path, env={**os.environ, **s3_env.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # Imported while the job starts (the test scores the exported model with them).
    import pyarrow.parquet as pq
    import tensorflow as tf

    try:
        # The PS logs a checkpoint once its shard and marker are in the bucket: then kill it. (Its
        # log, not the bucket, is polled: the test adds no requests to the server while the job runs.)
        ps_log = tmp_path / "runs" / "s3-deepfm" / "logs" / "ps-0.log"
        _wait_for(lambda: ps_log.exists() and "checkpoint at version 10" in ps_log.read_text(), 120, "a checkpoint")
        assert s3.glob(f"{bucket}/ckpt/version-10/ps-0-of-1*.npz.committed")
        os.kill(_ps_pids(proc.pid, tmp_path)[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out[out.index("{"):])
    assert report["ps_relaunches"] == 1
    (rollback,) = report["ps_rollbacks"]
    assert rollback["to_version"] >= 10
    log = (tmp_path / "runs" / "s3-deepfm" / "logs" / "master.log").read_text()
    assert f"from the checkpoint {root}/ckpt/version-{rollback['to_version']}" in log  # restored from the bucket
    assert report["exactly_once"]["holds"] and report["exactly_once"]["records_done"] == 4_000
    secret = s3_env.env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in log and secret not in err and secret not in out  # credentials are never logged
    for role_log in (tmp_path / "runs" / "s3-deepfm" / "logs").iterdir():
        assert secret not in role_log.read_text(), role_log.name
    # Each task after the first was promised with the one before and read while that one trained.
    worker_log = (tmp_path / "runs" / "s3-deepfm" / "logs" / "worker-0.log").read_text()
    ahead, tasks = map(int, re.search(r"the records of (\d+) of (\d+) tasks were read ahead", worker_log).groups())
    assert tasks >= 4 and ahead >= 2, worker_log[-2000:]
    assert report["saved_model"] == f"{root}/model"
    assert report["checkpoint"].startswith(f"{root}/ckpt/version-")

    s3.get(f"{bucket}/model/", str(tmp_path / "model") + "/", recursive=True)
    model = tf.saved_model.load(str(tmp_path / "model"))
    with s3.open(f"{bucket}/ctr/test/part-000.parquet") as f:
        test = pq.read_table(f)
    scores = model.signatures["serving_default"](tf.constant(_ids(test, meta["max_tags"], meta["pad_id"])))
    scores = next(iter(scores.values())).numpy().ravel()
    sys.path.insert(0, MODEL_ZOO)
    try:
        from deepctr.generate_data import auc
    finally:
        sys.path.remove(MODEL_ZOO)
    score = auc(test["label"].to_numpy(), scores)
    print(f"job {report['seconds']:.1f}s, test AUC {score:.4f}, ceiling {meta['auc_ceiling']:.4f}")
    assert 0.0 < scores.min() and scores.max() < 1.0
    assert score > 0.6, f"the exported DeepFM scores the test split with AUC {score:.4f}"
