"""The dac_ctr models, each ``model(input_layers, standardized, ids, max_id)`` as in the
original's wide_deep_model.py, deepfm_model.py, xdeepfm_model.py and dcn_model.py."""

import tensorflow as tf

from elasticdl.python.elasticdl.layers.embedding import Embedding


def _outputs(input_layers, logits):
    return tf.keras.Model(inputs=input_layers, outputs={"logits": logits, "probs": tf.sigmoid(logits)})


def wide_deep_model(input_layers, standardized, ids, max_id):
    wide = tf.reduce_sum(Embedding(1, input_dim=max_id, name="wide")(ids), axis=1)
    deep = tf.keras.layers.Flatten()(Embedding(4, input_dim=max_id, name="deep")(ids))
    deep = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Concatenate()([standardized, deep]))
    return _outputs(input_layers, tf.keras.layers.Add()([wide, tf.keras.layers.Dense(1)(deep)]))


def deepfm_model(input_layers, standardized, ids, max_id):
    factors = Embedding(4, input_dim=max_id, name="factors")(ids)
    first = tf.reduce_sum(Embedding(1, input_dim=max_id, name="linear")(ids), axis=1)
    total = tf.reduce_sum(factors, axis=1)
    second = 0.5 * tf.reduce_sum(tf.square(total) - tf.reduce_sum(tf.square(factors), axis=1), axis=1, keepdims=True)
    deep = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Flatten()(factors))
    return _outputs(input_layers, first + second + tf.keras.layers.Dense(1)(deep))


def xdeepfm_model(input_layers, standardized, ids, max_id):
    factors = Embedding(4, input_dim=max_id, name="factors")(ids)  # [batch, fields, dim]
    # One compressed interaction layer: outer products of the field rows, summed by a 1x1 conv.
    interactions = tf.einsum("bfd,bgd->bfgd", factors, factors)
    fields = factors.shape[1]
    cin = tf.keras.layers.Conv1D(4, 1)(tf.reshape(tf.transpose(interactions, [0, 3, 1, 2]), [-1, 4, fields * fields]))
    cin = tf.reduce_sum(cin, axis=1)
    deep = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Flatten()(factors))
    x = tf.keras.layers.Concatenate()([cin, deep, standardized])
    return _outputs(input_layers, tf.keras.layers.Dense(1)(x))


def dcn_model(input_layers, standardized, ids, max_id):
    x0 = tf.keras.layers.Concatenate()([standardized, tf.keras.layers.Flatten()(Embedding(4, input_dim=max_id,
                                                                                          name="factors")(ids))])
    x = x0
    for i in range(2):  # cross layers: x_{l+1} = x0 * (x_l . w) + b + x_l
        x = x0 * tf.keras.layers.Dense(1, use_bias=False, name=f"cross_w{i}")(x) + x
    deep = tf.keras.layers.Dense(8, activation="relu")(x0)
    return _outputs(input_layers, tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()([x, deep])))


MODELS = {"wide_deep": wide_deep_model, "deepfm": deepfm_model, "xdeepfm": xdeepfm_model, "dcn": dcn_model}
