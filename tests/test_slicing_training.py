"""Sliced dense variables in training: two workers over real gRPC against in-process PS cores,
every variable sliced, equal bit for bit to the same job with whole variables; the SavedModel
exported from either is the same."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl.config import JobConfig
from elasticdl.master.preflight import check_job
from elasticdl.model.export import export_saved_model
from elasticdl.model.slicing import parse_slice_name
from elasticdl.model.spec import load_model_spec
from elasticdl.model.trainer import ModelSpecError, Trainer
from elasticdl.rpc.ps_client import PSClient
from elasticdl.worker.worker import Worker
from tests.test_embedding_training import parameter_servers
from tests.test_model_spec import data_file, write_model  # noqa: F401 (a fixture)

ZOO = os.path.join(os.path.dirname(__file__), "zoo")
STEPS = 4
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.1),
    "momentum": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(learning_rate=0.1),
}


@pytest.fixture(scope="module")
def spec():
    # Dense 64x64 (no bias) -> BatchNormalization (non-trainable moving statistics) -> Dense 64x10.
    return load_model_spec(ZOO, "bnzoo.digits_bn.custom_model")


def _data(seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.uniform(0, 255, (8, 64)).astype(np.float32), rng.integers(0, 10, (8, 1)))
            for _ in range(STEPS)]


def _initial(trainer: Trainer) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {name: rng.normal(scale=0.1, size=value.shape).astype(np.float32) + (1.0 if "variance" in name else 0.0)
            for name, value in trainer.get_params().items()}


def _train(spec, make_optimizer, slice_mb: float, export_to: str = ""):
    """Sync SGD, 2 PS, 2 workers taking turns (so that every sum adds in one order); the
    workers' final model, each PS's variable names, and the exported model's predictions."""
    data = [_data(1), _data(2)]
    with parameter_servers(make_optimizer(), num_ps=2, grads_to_wait=2) as (cores, addresses):
        clients = [PSClient(addresses, slice_dense_above_mb=slice_mb) for _ in range(2)]
        workers = [Worker(i, spec, Trainer(spec, {}), master=None, ps=clients[i], minibatch_size=8)
                   for i in range(2)]
        for worker in workers:
            worker.trainer.ensure_built(tf.constant(data[0][0][0]))
        workers[0].trainer.set_params(_initial(workers[0].trainer))
        workers[0]._initialize_ps()
        for step in range(STEPS):
            for worker, batches in zip(workers, data):
                worker.train_batch(tf.constant(batches[step][0]), tf.constant(batches[step][1]))
        assert [core.shard.version for core in cores] == [STEPS, STEPS]
        held = [sorted(core.shard.params) for core in cores]
        workers[1]._pull(everything=True)
        trained = workers[1].trainer.get_params()
        path = export_saved_model(workers[1].trainer.model, export_to) if export_to else ""
        for client in clients:
            client.close()
    if not path:
        return trained, held, None
    serving = tf.saved_model.load(path).signatures["serving_default"]
    argument = list(serving.structured_input_signature[1])[0]
    served = list(serving(**{argument: tf.constant(data[0][0][0])}).values())[0].numpy()
    return trained, held, served


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_two_workers_on_sliced_variables_train_bit_for_bit_as_on_whole_ones(spec, tmp_path, optimizer):
    exports = optimizer == "adam"  # a SavedModel takes seconds to write: one optimizer's will do
    whole, whole_held, whole_served = _train(spec, OPTIMIZERS[optimizer], -1, str(tmp_path / "whole") if exports else "")
    sliced, sliced_held, sliced_served = _train(spec, OPTIMIZERS[optimizer], 0, str(tmp_path / "sliced") if exports else "")
    # Every variable (the BatchNormalization's moving statistics too) is one slice on each PS.
    for ps_id, names in enumerate(sliced_held):
        assert {parse_slice_name(n).whole for n in names} == set(whole)
        assert {parse_slice_name(n).index for n in names} == {ps_id}
    assert not any("#" in n for names in whole_held for n in names)
    assert sorted(sliced) == sorted(whole)
    initial = _initial(_built(spec))
    for name, value in whole.items():
        np.testing.assert_array_equal(sliced[name], value, err_msg=name)
        assert not np.array_equal(value, initial[name]), name  # trained (or, for BN, updated)
    if exports:
        assert whole_served is not None and whole_served.shape == (8, 10)
        np.testing.assert_array_equal(sliced_served, whole_served)


def _built(spec) -> Trainer:
    trainer = Trainer(spec, {})
    trainer.ensure_built(tf.constant(_data(1)[0][0]))
    return trainer


def test_a_slice_that_does_not_fit_the_model_is_refused_by_name(spec):
    trainer = _built(spec)
    with pytest.raises(ModelSpecError, match=r"'hidden/kernel#slice-1-of-2' with shape \(31, 64\), which is not "
                                             r"rows 32:64 of this model's variable of shape \(64, 64\)"):
        trainer.set_params({"hidden/kernel#slice-1-of-2": np.zeros((31, 64), np.float32)})
    trainer.set_params({"hidden/kernel#slice-1-of-2": np.ones((32, 64), np.float32)})
    kernel = trainer.get_params()["hidden/kernel"]
    assert (kernel[32:] == 1).all() and not (kernel[:32] == 1).all()


@pytest.mark.parametrize("optimizer, slice_mb, refused", [
    ("keras.optimizers.SGD(learning_rate=0.1, clipnorm=1.0)", 0, True),
    ("keras.optimizers.SGD(learning_rate=0.1, clipnorm=1.0)", -1, False),  # nothing sliced
    ("keras.optimizers.SGD(learning_rate=0.1, clipvalue=1.0)", 0, False),  # elementwise
])
def test_clipnorm_with_a_sliced_variable_is_refused_at_submit(tmp_path, data_file, optimizer, slice_mb, refused):  # noqa: F811
    """clipnorm clips by each variable's norm, which no PS holding a slice sees: refused at submit,
    naming the flag and its way out."""
    zoo, model_def, _ = write_model(tmp_path, optimizer=f"def optimizer():\n    return {optimizer}\n")
    config = JobConfig.from_flags(model_zoo=zoo, model_def=model_def, training_data=data_file, minibatch_size=4,
                                  num_ps=2, slice_dense_above_mb=slice_mb)
    if not refused:
        check_job(config)
        return
    with pytest.raises(ModelSpecError, match=r"--slice_dense_above_mb cuts 2 variables \(logits/bias, logits/kernel\) "
                                             r".*clipnorm=1.0 clips each variable by its own norm.*Raise "
                                             r"--slice_dense_above_mb to 0.01 or more"):
        check_job(config)
