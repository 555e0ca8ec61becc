"""Run by tests/test_original_zoo.py in a fresh process (Keras 2 must be chosen before TensorFlow
is imported, and the test process has imported it with Keras 3): every model of the
original-style zoo through the submit-time checks, three training steps on in-process tables and
parameters, a SavedModel export, and the exported serving signature on a batch.

Usage: python tests/original_zoo_smoke.py ZOO OUT CASE...; a CASE is JSON:
{"model_def": ..., "data": ..., "flags": {flag: value}}. Prints one JSON line per model."""

from __future__ import annotations

import json
import os
import sys


def main(zoo: str, out: str, cases: list[str]) -> None:
    from elasticdl.config import JobConfig
    from elasticdl.model.keras_generation import settle

    for i, case in enumerate(map(json.loads, cases)):
        config = JobConfig.from_flags(model_zoo=zoo, model_def=case["model_def"], training_data=case["data"],
                                      minibatch_size=8, **case["flags"]).with_defaults()
        config = settle(config, announce=False)
        print(json.dumps(run_one(config, os.path.join(out, f"model-{i}"))), flush=True)


def run_one(config, export_dir: str) -> dict:
    import numpy as np
    import tensorflow as tf

    from elasticdl.master.preflight import check_job
    from elasticdl.model.embedding.backends import LocalTables
    from elasticdl.model.export import export_saved_model
    from elasticdl.model.non_trainable import NonTrainableChange
    from elasticdl.model.optimizers import make_optimizer
    from elasticdl.model.trainer import Trainer

    checked = check_job(config)
    spec = checked.spec
    trainer = Trainer(spec, config.training.model_params)
    tables = LocalTables()
    trainer.connect(tables)
    optimizer = make_optimizer(checked.optimizer_spec)
    from elasticdl.data.sources import read_records, record_format
    from elasticdl.mode import Mode
    from elasticdl.model.spec import DatasetMetadata
    from elasticdl.model.trainer import make_dataset

    path = checked.files[0][0]
    records = list(read_records(path, 0, 24))
    batches = list(make_dataset(spec, records, Mode.TRAINING, DatasetMetadata(record_format(path)), 8))
    trainer.ensure_built(batches[0][0])
    slots = {}
    losses = []
    moved: set[str] = set()
    for step, (features, labels) in enumerate(batches, start=1):
        loss, grads = trainer.compute_gradients(features, labels)
        losses.append(loss)
        params = trainer.get_params()
        for name, grad in grads.items():
            if isinstance(grad, NonTrainableChange):  # BatchNorm statistics: the PS adds the change
                params[name] = params[name] + grad.values
                moved.add(name)
            elif name in params:  # dense parameters, with the PS's optimizer (embedding rows: the full jobs)
                slots.setdefault(name, optimizer.create_slots(params[name]))
                optimizer.apply(params[name], grad, slots[name], step)
        trainer.set_params(params)
    model = trainer.serving_model(lambda name: tables.tables[name].state()[:2])
    expected = [np.asarray(t) for t in tf.nest.flatten(model(batches[0][0], training=False))]
    export_saved_model(model, export_dir)
    loaded = tf.saved_model.load(export_dir)
    serve = loaded.signatures["serving_default"]
    features = batches[0][0]
    inputs = features if isinstance(features, dict) else {"features": features}
    outputs = serve(**{k: tf.convert_to_tensor(v) for k, v in inputs.items()})
    rows = {k: np.asarray(v).shape[0] for k, v in outputs.items()}
    served = tf.nest.flatten(loaded.serve(features))  # Keras 3's second endpoint, on Keras 2 exports too
    rows["serve"] = int(np.asarray(served[0]).shape[0])
    # Lookup tables, embeddings and BatchNorm statistics restored: the same outputs as the model's.
    same = len(served) == len(expected) and all(
        np.allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5) for a, b in zip(served, expected))
    return {"model_def": config.training.model_def, "losses": losses, "finite": bool(np.all(np.isfinite(losses))),
            "variables": len(trainer.variables), "non_trainable_moved": len(moved), "tables": sorted(trainer.embeddings.infos),
            "serving_rows": rows, "serves_as_trained": bool(same), "optimizer": checked.optimizer_spec.name}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
