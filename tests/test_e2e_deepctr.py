"""End to end: DeepFM on synthetic click data, 2 workers + 2 PS, embedding tables on the PS."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ZOO = os.path.join(REPO, "model_zoo")
TABLES = ("linear/embeddings", "factors/embeddings")


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory):
    sys.path.insert(0, MODEL_ZOO)
    try:
        from deepctr.generate_data import generate
    finally:
        sys.path.remove(MODEL_ZOO)
    out = tmp_path_factory.mktemp("deepctr")
    meta = generate(str(out), train_records=20_000, test_records=5_000)
    return out, meta


class RestoredPS:
    """Rows from in-process PS cores restored from a checkpoint (a RowSource for a Trainer)."""

    def __init__(self, cores):
        self.cores = cores

    def lookup(self, name, ids, create, snapshot_id=0):
        out = np.zeros((ids.size, self.cores[0].shard.embeddings[name].dim), np.float32)
        for core in self.cores:
            mine = ids % len(self.cores) == core.settings.ps_id
            out[mine] = core.lookup_embeddings(name, ids[mine], create)
        return out


def test_deepfm_two_workers_two_ps_reaches_the_auc_ceiling_and_exports(ctr_data, tmp_path):
    data, meta = ctr_data
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", MODEL_ZOO,
         "--model_def", "deepctr.deepfm.custom_model",
         "--training_data", str(data / "train"), "--validation_data", str(data / "test"),
         "--num_workers", "2", "--num_ps", "2", "--grads_to_wait", "2",
         "--minibatch_size", "256", "--num_epochs", "3",
         "--checkpoint_dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "model"), "--job_name", "deepfm"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    auc, ceiling = report["metrics"]["auc"], meta["auc_ceiling"]
    print(f"job {report['seconds']:.1f}s, AUC {auc:.4f}, ceiling {ceiling:.4f}")
    assert auc >= ceiling - 0.03, f"DeepFM AUC {auc:.4f}, the ground truth allows {ceiling:.4f}"
    assert report["records_trained"] == 3 * 20_000 and report["dropped_tasks"] == 0

    # The checkpoint holds every trained id once, on PS id % 2, with Adagrad's accumulators.
    import tensorflow as tf

    train_ids = []
    for record in tf.data.TFRecordDataset(sorted(glob.glob(str(data / "train" / "*.tfrecord")))):
        example = tf.train.Example.FromString(record.numpy())
        train_ids.append(example.features.feature["ids"].int64_list.value)
    train_ids = np.array(train_ids, np.int64)
    for table in TABLES:
        held = []
        for ps_id in range(2):
            with np.load(os.path.join(report["checkpoint"], f"ps-{ps_id}-of-2.term-1.npz")) as shard:
                ids = shard[f"embedding_ids:{table}"]
                assert np.all(ids % 2 == ps_id)
                assert shard[f"embedding_slot:accumulator:{table}"].shape == shard[f"embedding_rows:{table}"].shape
                held.append(ids)
        np.testing.assert_array_equal(np.sort(np.concatenate(held)), np.unique(train_ids))

    # The SavedModel (tables inside it, no PS) predicts what the trained model predicts through
    # parameter servers, here one PS restored from the 2-PS checkpoint (re-sharded).
    from elasticdl.model.optimizers import make_optimizer, optimizer_spec_from_keras
    from elasticdl.model.spec import load_model_spec
    from elasticdl.model.trainer import Trainer
    from elasticdl.ps.server import ParameterServer, PSSettings

    spec = load_model_spec(MODEL_ZOO, "deepctr.deepfm.custom_model")
    core = ParameterServer(
        PSSettings(num_ps=1, checkpoint_dir_for_init=report["checkpoint"]),
        make_optimizer(optimizer_spec_from_keras(spec.optimizer())),
    )
    core.restore()
    trainer = Trainer(spec, {})
    trainer.connect(RestoredPS([core]))
    sample = tf.constant(train_ids[:4096])
    trainer.ensure_built(sample)
    trainer.set_params(core.shard.params)
    distributed = trainer.model(sample, training=False).numpy()
    serving = tf.saved_model.load(report["saved_model"]).signatures["serving_default"]
    served = list(serving(ids=sample).values())[0].numpy()
    np.testing.assert_allclose(served, distributed, atol=1e-6)
    assert 0.05 < distributed.mean() < 0.95
