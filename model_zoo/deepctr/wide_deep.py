"""Wide & Deep (Cheng et al., 2016) on the synthetic click data, written as a plain Keras model.

    elasticdl train --model_zoo model_zoo --model_def deepctr.wide_deep.custom_model \\
        --training_data data/deepctr/train --validation_data data/deepctr/test \\
        --num_workers 2 --num_ps 2 --minibatch_size 256 --num_epochs 3

Its tables are ordinary ``keras.layers.Embedding`` layers over the whole id range
(1,261,125 ids): 4.8 MiB and 38.5 MiB, both above --embedding_swap_threshold_mb (2 MiB),
so ElasticDL swaps them for elasticdl.layers.Embedding and logs it; the model file needs
no ElasticDL import and runs as is with ``model.fit``.
"""

import keras
from deepctr.common import NUM_FIELDS, dataset_fn, eval_metrics_fn, loss  # noqa: F401

VOCABULARY = 1_261_125  # generate_data.VOCABULARY


def custom_model(embedding_dim=8, hidden_units=32):
    ids = keras.Input(shape=(NUM_FIELDS,), dtype="int64", name="ids")
    wide = keras.layers.Embedding(VOCABULARY, 1, embeddings_initializer="zeros", name="wide")(ids)
    wide = keras.ops.sum(wide, axis=1)  # a linear model over the one-hot ids
    rows = keras.layers.Embedding(VOCABULARY, embedding_dim, name="deep_embedding")(ids)
    hidden = keras.layers.Dense(hidden_units, activation="relu", name="hidden")(keras.layers.Flatten()(rows))
    deep = keras.layers.Dense(1, name="deep")(hidden)
    probability = keras.layers.Activation("sigmoid", name="probability")(wide + deep)
    return keras.Model(ids, probability, name="wide_deep")


def optimizer(lr=0.3):
    return keras.optimizers.Adagrad(learning_rate=lr)
