"""End to end: DeepFM with bounded tables (max_rows, admit_min_count), 2 workers + 2 PS: it trains
within the bound, checkpoints, restores, and the report counts rows, admissions, evictions and
dropped gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")
TABLES = ("linear/embeddings", "factors/embeddings")
MAX_ROWS = 1500


def train(data, tmp_path, name: str, *extra: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO,
         "--model_def", "deepctr.deepfm.custom_model",
         "--model_params", f"max_rows={MAX_ROWS};admit_min_count=2",
         "--training_data", str(data / "train"), "--validation_data", str(data / "test"),
         "--num_workers", "2", "--num_ps", "2", "--grads_to_wait", "2", "--minibatch_size", "256",
         "--output", str(tmp_path / f"{name}-model"), "--job_name", name, *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_deepfm_with_bounded_tables_trains_checkpoints_restores_and_reports(tmp_path):
    sys.path.insert(0, MODEL_ZOO)
    try:
        from deepctr.generate_data import generate
    finally:
        sys.path.remove(MODEL_ZOO)
    data = tmp_path / "deepctr"
    meta = generate(str(data), train_records=10_000, test_records=4_000)

    first = train(data, tmp_path, "bounded", "--num_epochs", "2", "--checkpoint_dir", str(tmp_path / "ckpt"))
    auc = first["metrics"]["auc"]
    print(f"bounded DeepFM: AUC {auc:.4f} (ceiling {meta['auc_ceiling']:.4f}); tables {first['embedding_tables']}")
    assert auc > 0.6 and first["records_trained"] == 2 * 10_000 and first["exactly_once"]["holds"]
    for table in TABLES:
        t = first["embedding_tables"][table]
        assert 0 < t["rows"] <= 2 * MAX_ROWS  # two PS, each capped
        assert t["evictions_max_rows"] > 0 and t["dropped_gradients"] > 0
        assert t["admissions"] - t["evictions_max_rows"] - t["evictions_ttl"] == t["rows"]

    # The checkpoint holds live rows only, with what a restore needs to go on exactly.
    for table in TABLES:
        rows = 0
        for ps_id in range(2):
            with np.load(os.path.join(first["checkpoint"], f"ps-{ps_id}-of-2.term-1.npz")) as shard:
                ids = shard[f"embedding_ids:{table}"]
                assert ids.size <= MAX_ROWS and np.all(ids % 2 == ps_id) and np.unique(ids).size == ids.size
                assert shard[f"embedding_touched:{table}"].shape == ids.shape
                assert shard[f"embedding_meta:sketch:{table}"].dtype == np.uint16
                rows += ids.size
        assert rows == first["embedding_tables"][table]["rows"]

    # A job that starts from the checkpoint restores the rows and goes on counting from its counters.
    second = train(data, tmp_path, "resumed", "--num_epochs", "1", "--checkpoint_dir_for_init", first["checkpoint"])
    assert second["restored_from"] == first["checkpoint"]
    print(f"restored: AUC {second['metrics']['auc']:.4f}; tables {second['embedding_tables']}")
    assert second["metrics"]["auc"] > 0.6
    for table in TABLES:
        before, after = first["embedding_tables"][table], second["embedding_tables"][table]
        assert after["rows"] <= 2 * MAX_ROWS
        for counter in ("admissions", "evictions_max_rows"):
            assert after[counter] > before[counter], (table, counter, before, after)
        # The restored sketch remembers the first job's sightings: every id of the data had its
        # two already, so none is dropped now (a sketch that restarted empty would drop again).
        assert after["dropped_gradients"] == before["dropped_gradients"]
