"""DeepFM (Guo et al., 2017) on the synthetic click data, with its tables on the parameter servers.

    python model_zoo/deepctr/generate_data.py --output data/deepctr
    elasticdl train --model_zoo model_zoo --model_def deepctr.deepfm.custom_model \\
        --training_data data/deepctr/train --validation_data data/deepctr/test \\
        --num_workers 2 --num_ps 2 --grads_to_wait 2 --minibatch_size 256 --num_epochs 3

Two elasticdl.layers.Embedding tables serve all eight fields: ``linear`` (one weight per id,
the first-order term) and ``factors`` (the latent vectors shared by the FM and the deep
part). Neither has a size: ids are any int64 >= 0, and a row exists on a PS once its id
was seen in training. ``max_rows``, ``admit_min_count`` and ``ttl_versions`` (model params,
e.g. ``--model_params "max_rows=5000;admit_min_count=2"``) bound both tables
(docs/embeddings.md, "Bounded tables").
"""

import keras
from deepctr.common import NUM_FIELDS, dataset_fn, eval_metrics_fn, loss  # noqa: F401

from elasticdl.layers import Embedding


def custom_model(factor_dim=8, hidden_units=16, num_fields=NUM_FIELDS, max_rows=0, admit_min_count=1, ttl_versions=0):
    bounds = {"max_rows": max_rows, "admit_min_count": admit_min_count, "ttl_versions": ttl_versions}
    ids = keras.Input(shape=(num_fields,), dtype="int64", name="ids")
    weights = Embedding(1, embeddings_initializer="zeros", name="linear", **bounds)(ids)  # [batch, fields, 1]
    factors = Embedding(factor_dim, name="factors", **bounds)(ids)  # [batch, fields, k]
    linear = keras.ops.sum(weights, axis=1)
    total = keras.ops.sum(factors, axis=1)
    # FM: sum over field pairs of <v_f, v_g> = ((sum v)^2 - sum v^2) / 2.
    fm = 0.5 * keras.ops.sum(total * total - keras.ops.sum(factors * factors, axis=1), axis=1, keepdims=True)
    hidden = keras.layers.Dense(hidden_units, activation="relu", name="hidden")(keras.layers.Flatten()(factors))
    deep = keras.layers.Dense(1, name="deep")(hidden)
    probability = keras.layers.Activation("sigmoid", name="probability")(linear + fm + deep)
    return keras.Model(ids, probability, name="deepfm")


def optimizer(lr=0.5):
    # Adagrad: a row seen once takes a small step, so rare ids do not memorise their labels.
    return keras.optimizers.Adagrad(learning_rate=lr)
