"""A click model whose ids never stop arriving (issue 28's endless-id run, benchmarks/endless_ids.py).

Each record holds ``IDS`` ids (``benchmarks/endless_ids.py`` writes them): items that stay,
users that come and go, and one-off ids, so that new ids keep coming and most are never seen
again, as in a live service. The label follows a known truth: the sum of the item and user
ids' hidden weights.

``ttl_versions`` and ``max_rows`` (``--model_params``) bound the table on each PS; 0 bounds nothing.
"""

import keras
import tensorflow as tf

from elasticdl.layers import Embedding

IDS = 8


def custom_model(ttl_versions=0, max_rows=0, dim=32):
    ids = keras.Input(shape=(IDS,), dtype="int64", name="ids")
    rows = Embedding(dim, combiner="sum", name="ids_table", ttl_versions=int(ttl_versions),
                     max_rows=int(max_rows))(ids)  # [batch, dim]
    logit = keras.layers.Dense(1, name="logit")(rows)
    return keras.Model(ids, keras.layers.Activation("sigmoid", name="probability")(logit))


def loss(labels, predictions):
    return keras.losses.binary_crossentropy(tf.reshape(tf.cast(labels, tf.float32), [-1, 1]), predictions)


def optimizer(lr=0.01):
    return keras.optimizers.Adam(learning_rate=lr)


_FEATURES = {"ids": tf.io.FixedLenFeature([IDS], tf.int64), "label": tf.io.FixedLenFeature([1], tf.int64)}


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        return {"ids": example["ids"]}, example["label"]

    return dataset.map(parse)


def eval_metrics_fn():
    return {"auc": keras.metrics.AUC(name="auc")}
