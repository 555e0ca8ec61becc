"""End to end: BatchNormalization's moving statistics train on the parameter servers.

Raw pixels (0..255) go straight into a Dense -> BatchNormalization model (tests/zoo/bnzoo).
Two workers and one PS train it with sync SGD over real gRPC; the exported SavedModel must
predict as well as the same module trained by ``model.fit`` in one process, which it could not
while the moving mean and variance stayed at 0 and 1 (0.1 less accuracy, measured below).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(REPO, "tests", "zoo")
MODEL_DEF = "bnzoo.digits_bn.custom_model"
EPOCHS, BATCH = 4, 32


def _example(image: np.ndarray, label: int) -> bytes:
    import tensorflow as tf

    return tf.train.Example(features=tf.train.Features(feature={
        "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.tolist())),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    })).SerializeToString()


@pytest.fixture(scope="module")
def raw_digits(tmp_path_factory):
    """scikit-learn's digits (0..16 per pixel) scaled to 0..255, split with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from elasticdl.data.tfrecord import write_records

    digits = load_digits()
    images = np.minimum(digits.data * 16, 255).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
    out = tmp_path_factory.mktemp("raw_digits")
    for split, xs, ys in (("train", x_train, y_train), ("test", x_test, y_test)):
        os.makedirs(out / split)
        write_records(out / split / "digits.tfrecord", (_example(x, y) for x, y in zip(xs, ys)))
    return out, (x_train, y_train), (x_test, y_test)


def _accuracy(predict, images, labels) -> float:
    return float(np.mean(np.argmax(np.asarray(predict(images)), axis=1) == labels))


def test_a_batchnorm_model_on_raw_pixels_exports_what_model_fit_trains(raw_digits, tmp_path):
    data, (x_train, y_train), (x_test, y_test) = raw_digits
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl", "train", "--model_zoo", ZOO, "--model_def", MODEL_DEF,
         "--training_data", str(data / "train"), "--validation_data", str(data / "test"),
         "--minibatch_size", str(BATCH), "--num_epochs", str(EPOCHS), "--num_workers", "2", "--num_ps", "1",
         "--grads_to_wait", "2", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output", str(tmp_path / "model")],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["consistency"] == "sync SGD, grads_to_wait=2"

    import keras
    import tensorflow as tf

    from elasticdl.model.spec import load_model_spec

    serving = tf.saved_model.load(report["saved_model"]).signatures["serving_default"]
    exported = _accuracy(lambda x: list(serving(tf.constant(x)).values())[0], x_test, y_test)

    # The same module, trained by Keras in this process with the same epochs and batch size.
    spec = load_model_spec(ZOO, MODEL_DEF)
    keras.utils.set_random_seed(0)
    reference = spec.build_model({})
    reference.compile(optimizer=spec.optimizer(), loss=spec.loss)
    reference.fit(x_train, y_train, epochs=EPOCHS, batch_size=BATCH, verbose=0)
    fitted = _accuracy(lambda x: reference(x, training=False), x_test, y_test)
    bn = reference.get_layer("bn")
    bn.moving_mean.assign(np.zeros(64, np.float32))
    bn.moving_variance.assign(np.ones(64, np.float32))
    untrained = _accuracy(lambda x: reference(x, training=False), x_test, y_test)
    print(f"exported {exported:.3f}, model.fit {fitted:.3f}, model.fit with initial statistics {untrained:.3f}, "
          f"evaluation rounds {report['metrics']['accuracy']:.3f}")
    assert fitted - untrained > 0.05  # the statistics matter for this model
    assert abs(exported - fitted) <= 0.03
    # The evaluation rounds ran on PS snapshots, with the trained statistics too.
    assert abs(report["metrics"]["accuracy"] - exported) <= 0.03

    # The checkpoint holds the statistics of the hidden units over the training data (in the
    # hundreds for raw pixels; they start at 0 and 1), next to the kernel they were trained with.
    (path,) = glob.glob(os.path.join(report["checkpoint"], "ps-0-of-1*.npz"))
    with np.load(path) as shard:
        kernel = shard["param:hidden/kernel"]
        mean, variance = shard["non_trainable:bn/moving_mean"], shard["non_trainable:bn/moving_variance"]
        assert not any(key.startswith("slot:") and "/moving_" in key for key in shard.files)
    hidden = x_train @ kernel
    assert np.corrcoef(mean, hidden.mean(axis=0))[0, 1] > 0.95
    assert np.corrcoef(variance, hidden.var(axis=0))[0, 1] > 0.9
    assert np.abs(mean).max() > 10
