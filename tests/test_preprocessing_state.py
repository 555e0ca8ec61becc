"""The master's preprocessing state, handed to a worker (elasticdl/model/preprocessing_state.py).

Two "processes" are two imports of the same module text adapted on different data: the
worker's layers must end with the master's state, and their digests must match.
"""

import types

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from elasticdl.model import preprocessing_state as ps  # noqa: E402

MODULE_TEXT = '''
import numpy as np
import keras

rng = np.random.default_rng(SEED)
normalize = keras.layers.Normalization()
normalize.adapt(rng.normal(size=(64, 3)).astype("float32"))
cities = keras.layers.StringLookup()
cities.adapt(np.array([f"city{i}" for i in rng.integers(0, 40, size=50)]))
lookups = {"age": keras.layers.Discretization(num_bins=4)}
lookups["age"].adapt(rng.normal(size=(64,)).astype("float32"))
preprocess = keras.Sequential([keras.layers.Normalization(name="scale")])  # a module-level model of them
preprocess.layers[0].adapt(rng.normal(size=(32, 2)).astype("float32"))


def custom_model():
    own = keras.layers.IntegerLookup()
    own.adapt(np.random.default_rng(SEED).integers(0, 100, size=30))
    inputs = keras.Input((3,))
    x = normalize(inputs)
    x = keras.layers.Dense(1)(x)
    model = keras.Model(inputs, x)
    model.own = own
    return model
'''


def _process(seed: int):
    module = types.ModuleType(f"zoo_{seed}")
    exec(MODULE_TEXT.replace("SEED", str(seed)), vars(module))  # noqa: S102  (the test's own text)
    return module


def _spec(module):
    return types.SimpleNamespace(model_fn=types.SimpleNamespace(__module__=module.__name__))


def _over_the_wire(state):
    """What a worker gets: the bytes the master serves (get_preprocessing_state), read back."""
    return ps.PreprocessingState.from_bytes(state.to_bytes())


def test_a_worker_takes_the_masters_state(monkeypatch):
    master = _process(1)
    master_model = master.custom_model()
    worker = _process(2)
    for module in (master, worker):
        monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    sent = ps.hand_off(_spec(master), master_model)
    assert sent.layers == 5  # four in the module (one in a dict, one in a Sequential), one of the model's own
    assert ps.collect(worker, worker.custom_model()).digest() != sent.digest()  # adapted on other data

    takeover = ps.Takeover(_spec(worker), _over_the_wire(sent))
    takeover.before_build()
    model = worker.custom_model()
    takeover.after_build(model)

    assert ps.collect(worker, model).digest() == sent.digest()
    assert worker.cities.get_vocabulary() == master.cities.get_vocabulary()
    assert list(worker.lookups["age"].bin_boundaries) == list(master.lookups["age"].bin_boundaries)
    assert model.own.get_vocabulary() == master_model.own.get_vocabulary()
    np.testing.assert_array_equal(worker.preprocess.layers[0].mean, master.preprocess.layers[0].mean)
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(worker.normalize(x), master.normalize(x), rtol=1e-6)
    np.testing.assert_array_equal(worker.lookups["age"](np.array([0.1, -0.4])),
                                  master.lookups["age"](np.array([0.1, -0.4])))


def test_without_the_masters_state_a_worker_keeps_its_own_state_and_says_so(caplog):
    worker = _process(3)
    __import__("sys").modules[worker.__name__] = worker
    takeover = ps.Takeover(_spec(worker), None)
    before = worker.cities.get_vocabulary()
    takeover.before_build()
    takeover.after_build(worker.custom_model())
    assert worker.cities.get_vocabulary() == before
    assert "no preprocessing state from the master" in caplog.text


def test_a_model_without_preprocessing_hands_nothing_on():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    state = ps.hand_off(types.SimpleNamespace(model_fn=types.SimpleNamespace(__module__="plain")), model)
    assert not state.arrays and state.to_bytes() == b""
    assert not ps.PreprocessingState.from_bytes(b"").arrays


def test_a_layer_the_worker_cannot_take_keeps_its_own_state_with_a_warning(monkeypatch, caplog):
    master, worker = _process(4), _process(5)
    worker.normalize = keras.layers.Normalization()  # another width than the master's: its weights do not fit
    worker.normalize.adapt(np.zeros((4, 2), "float32"))
    for module in (master, worker):
        monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    ps.Takeover(_spec(worker), _over_the_wire(ps.hand_off(_spec(master), None))).before_build()
    assert worker.cities.get_vocabulary() == master.cities.get_vocabulary()  # the others are taken
    assert worker.normalize.mean.shape[-1] == 2
    assert "cannot take (module.normalize/0:Normalization (ValueError" in caplog.text


FEATURE_SPACE_TEXT = '''
import numpy as np
import keras
from keras.utils import FeatureSpace

rng = np.random.default_rng(SEED)
data = {"age": rng.normal(40, 10, size=(200,)).astype("float32"),
        "city": np.array([f"c{i}" for i in rng.integers(0, 30, size=200)]),
        "kids": rng.integers(0, 5, size=200)}
feature_space = FeatureSpace(
    features={"age": FeatureSpace.float_discretized(num_bins=8), "city": "string_categorical",
              "kids": "integer_categorical", "income": "float_normalized"},
    output_mode="concat",
)
data["income"] = rng.normal(size=(200,)).astype("float32")
import tensorflow as tf
feature_space.adapt(tf.data.Dataset.from_tensor_slices(data).batch(50))
'''


def test_feature_space_bins_and_vocabularies_come_from_the_master(monkeypatch):
    modules = []
    for seed in (11, 12):
        module = types.ModuleType(f"fs_{seed}")
        exec(FEATURE_SPACE_TEXT.replace("SEED", str(seed)), vars(module))  # noqa: S102
        monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
        modules.append(module)
    master, worker = modules
    sent = ps.hand_off(_spec(master), None)
    age = worker.feature_space.preprocessors["age"]
    assert list(age.bin_boundaries) != list(master.feature_space.preprocessors["age"].bin_boundaries)

    ps.Takeover(_spec(worker), _over_the_wire(sent)).before_build()

    assert ps.collect(worker, None).digest() == sent.digest()
    assert list(age.bin_boundaries) == list(master.feature_space.preprocessors["age"].bin_boundaries)
    row = {"age": np.array([35.0], "float32"), "city": np.array(["c3"]), "kids": np.array([2]),
           "income": np.array([0.5], "float32")}
    np.testing.assert_allclose(worker.feature_space(row), master.feature_space(row), rtol=1e-6)


KERAS2_SCRIPT = """import os, sys, types
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np
from elasticdl.model import preprocessing_state as ps

TEXT = '''
import numpy as np
import tensorflow as tf
import tf_keras as keras
rng = np.random.default_rng(SEED)
normalize = keras.layers.Normalization()
normalize.adapt(rng.normal(size=(64, 3)).astype("float32"))
cities = keras.layers.StringLookup()
cities.adapt(np.array([f"city{i}" for i in rng.integers(0, 40, size=50)]))
bins = keras.layers.Discretization(num_bins=4)
bins.adapt(rng.normal(size=(64,)).astype("float32"))
fs = keras.utils.FeatureSpace(features={"age": keras.utils.FeatureSpace.float_discretized(num_bins=5),
    "city": "string_categorical"}, output_mode="concat")
fs.adapt(tf.data.Dataset.from_tensor_slices({"age": rng.normal(size=(100,)).astype("float32"),
    "city": np.array([f"c{i}" for i in rng.integers(0, 9, size=100)])}).batch(20))
'''
mods = []
for seed in (1, 2):
    m = types.ModuleType(f"k2_{seed}"); exec(TEXT.replace("SEED", str(seed)), vars(m)); sys.modules[m.__name__] = m; mods.append(m)
spec = lambda m: types.SimpleNamespace(model_fn=types.SimpleNamespace(__module__=m.__name__))
sent = ps.hand_off(spec(mods[0]), None)
assert ps.collect(mods[1], None).digest() != sent.digest()
ps.Takeover(spec(mods[1]), ps.PreprocessingState.from_bytes(sent.to_bytes())).before_build()
assert ps.collect(mods[1], None).digest() == sent.digest(), "digest"
x = np.ones((2, 3), "float32")
np.testing.assert_allclose(mods[1].normalize(x), mods[0].normalize(x), rtol=1e-6)
v = np.array([0.1, -0.4, 1.2], "float32")
np.testing.assert_array_equal(mods[1].bins(v), mods[0].bins(v))
np.testing.assert_array_equal(mods[1].cities(np.array(["city3", "city9"])), mods[0].cities(np.array(["city3", "city9"])))
row = {"age": np.array([0.3], "float32"), "city": np.array(["c2"])}
np.testing.assert_allclose(mods[1].fs(row), mods[0].fs(row))
print("keras2 ok", sent.layers, sent.digest())
"""


def test_keras2_layers_take_the_masters_state_too(tmp_path):
    """tf_keras (TF_USE_LEGACY_KERAS=1) must be chosen before TensorFlow's import: a process of its own."""
    import os
    import subprocess
    import sys

    pytest.importorskip("tf_keras")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", KERAS2_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": repo, "TF_USE_LEGACY_KERAS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "keras2 ok 5" in result.stdout
