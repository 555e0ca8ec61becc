"""DeepFM (model_zoo/deepctr/deepfm.py) with fixed-size ``keras.layers.Embedding`` tables.

The zoo's DeepFM uses ``elasticdl.layers.Embedding`` (no size: it runs in ElasticDL only).
Here both tables are plain Keras layers of ``vocabulary`` rows, so this one file runs as is
under ``model.fit`` and ParameterServerStrategy, while ElasticDL swaps the tables for
parameter-server tables (--embedding_swap_threshold_mb; the benchmark passes 0 so that
the small tables of --quick are swapped too). Architecture, loss, parsing and optimizer
are the zoo's.

    vocabulary=1,000,000: linear 1M x 1 and factors 1M x 8 floats (36 MB), then Dense(16), Dense(1)

Records: ``benchmarks/data.py`` writes model_zoo/deepctr/generate_data.py's click data
with the ids folded modulo ``vocabulary``.
"""

import importlib.util
import os
import sys

import keras


def _zoo_common():
    """The repository zoo's model_zoo/deepctr/common.py, loaded from its path: while this zoo
    (benchmarks/model_zoo) is loaded, ``model_zoo`` names *this* directory (the original
    ElasticDL's ``from model_zoo.x import y``, elasticdl/model/spec.py), which has no deepctr."""
    name = "_bench_deepctr_common"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "model_zoo", "deepctr",
                            "common.py")
        spec = importlib.util.spec_from_file_location(name, os.path.normpath(path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The zoo's record parsing and loss.
NUM_FIELDS, dataset_fn, loss = _zoo_common().NUM_FIELDS, _zoo_common().dataset_fn, _zoo_common().loss

VOCABULARY = 1_000_000


def custom_model(vocabulary=VOCABULARY, factor_dim=8, hidden_units=16):
    ids = keras.Input(shape=(NUM_FIELDS,), dtype="int64", name="ids")
    weights = keras.layers.Embedding(vocabulary, 1, embeddings_initializer="zeros", name="linear")(ids)
    factors = keras.layers.Embedding(vocabulary, factor_dim, name="factors")(ids)  # [batch, fields, k]
    linear = keras.ops.sum(weights, axis=1)
    total = keras.ops.sum(factors, axis=1)
    # FM: sum over field pairs of <v_f, v_g> = ((sum v)^2 - sum v^2) / 2.
    fm = 0.5 * keras.ops.sum(total * total - keras.ops.sum(factors * factors, axis=1), axis=1, keepdims=True)
    hidden = keras.layers.Dense(hidden_units, activation="relu", name="hidden")(keras.layers.Flatten()(factors))
    deep = keras.layers.Dense(1, name="deep")(hidden)
    probability = keras.layers.Activation("sigmoid", name="probability")(linear + fm + deep)
    return keras.Model(ids, probability, name="deepfm")


def optimizer(lr=0.5):
    return keras.optimizers.Adagrad(learning_rate=lr)  # as model_zoo/deepctr/deepfm.py
