"""A tiny click model for the embedding tests: a few id fields, one table, a dense head.

``custom_model(kind=...)``: "elasticdl" uses elasticdl.layers.Embedding, "keras" a plain
keras.layers.Embedding (swapped when larger than the threshold), "shared" one
elasticdl.layers.Embedding called on two inputs, "subclassed" a keras.Model subclass.
"""

import keras
import tensorflow as tf

from elasticdl import Mode
from elasticdl.layers import Embedding

FIELDS = 3
_FEATURES = {
    "ids": tf.io.FixedLenFeature([FIELDS], tf.int64),
    "label": tf.io.FixedLenFeature([1], tf.float32),
}


class SubclassedCtr(keras.Model):
    def __init__(self, vocab=50, dim=4):
        super().__init__(name="sub_ctr")
        self.emb = Embedding(dim, input_dim=vocab, name="emb")
        self.hidden = keras.layers.Dense(8, activation="tanh", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, ids):
        return self.out(self.hidden(keras.ops.reshape(self.emb(ids), (-1, FIELDS * self.emb.output_dim))))


def custom_model(kind="elasticdl", vocab=50, dim=4):
    if kind == "subclassed":
        return SubclassedCtr(vocab, dim)
    ids = keras.Input(shape=(FIELDS,), dtype="int64", name="ids")
    if kind == "keras":
        rows = keras.layers.Embedding(vocab, dim, name="emb")(ids)
    elif kind == "shared":
        table = Embedding(dim, input_dim=vocab, name="emb")
        rows = keras.layers.Concatenate(axis=1)([table(ids), table(ids[:, :1])])
    else:
        rows = Embedding(dim, input_dim=vocab, name="emb")(ids)
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(keras.layers.Flatten()(rows))
    return keras.Model(ids, keras.layers.Dense(1, name="out")(hidden), name="tiny_ctr")


def loss(labels, predictions):
    return tf.reduce_mean(tf.square(tf.reshape(labels, [-1]) - tf.reshape(predictions, [-1])))


def optimizer(lr=0.1):
    return keras.optimizers.SGD(learning_rate=lr)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        if mode == Mode.PREDICTION:
            return example["ids"]
        return example["ids"], example["label"]

    return dataset.map(parse)
