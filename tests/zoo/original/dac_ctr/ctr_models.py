"""The dac_ctr models, each ``model(input_layers, dense_tensor, id_tensors, max_ids)`` as in the
original's wide_deep_model.py, deepfm_model.py, xdeepfm_model.py and dcn_model.py: one Keras
Embedding per id group, summed over the group's features, a DNN layer class, and raw TF ops on
Keras tensors. (The original's deepfm, xdeepfm and dcn take FM, CIN and CrossNet from deepctr;
these are written here, small.)"""

import tensorflow as tf


class DNN(tf.keras.layers.Layer):
    def __init__(self, hidden_units, activation=None, **kwargs):
        super(DNN, self).__init__(**kwargs)
        if not hidden_units:
            raise ValueError("The hidden units cannot be empty")
        self.dense_layers = [tf.keras.layers.Dense(units, activation=activation) for units in hidden_units]

    def call(self, inputs):
        for layer in self.dense_layers:
            inputs = layer(inputs)
        return inputs


def lookup_embedding_func(id_tensors, max_ids, embedding_dim):
    return [tf.keras.backend.sum(tf.keras.layers.Embedding(max_ids[name], embedding_dim)(ids), axis=1)
            for name, ids in id_tensors.items()]


def _parts(dense_tensor, id_tensors, max_ids, dim=4):
    linear_logits = lookup_embedding_func(id_tensors, max_ids, 1)
    deep_embeddings = lookup_embedding_func(id_tensors, max_ids, dim)
    dnn_input = tf.reshape(deep_embeddings, shape=(-1, len(deep_embeddings) * dim))  # a list of Keras tensors
    if dense_tensor is not None:
        dnn_input = tf.keras.layers.Concatenate()([dense_tensor, dnn_input])
        linear_logits.append(tf.keras.layers.Dense(1, use_bias=False)(dense_tensor))
    linear_logit = tf.keras.layers.Concatenate()(linear_logits) if len(linear_logits) > 1 else linear_logits[0]
    return linear_logit, deep_embeddings, dnn_input


def _outputs(input_layers, concat_input, name):
    logits = tf.reduce_sum(concat_input, 1, keepdims=True)
    probs = tf.reshape(tf.sigmoid(logits), shape=(-1,))
    return tf.keras.Model(inputs=input_layers, outputs={"logits": logits, "probs": probs}, name=name)


def wide_deep_model(input_layers, dense_tensor, id_tensors, max_ids):
    linear_logit, _, dnn_input = _parts(dense_tensor, id_tensors, max_ids)
    dnn_logit = tf.keras.layers.Dense(1, use_bias=False)(DNN([8, 4], activation="relu")(dnn_input))
    return _outputs(input_layers, tf.concat([linear_logit, dnn_logit], 1), "wide_deep")


def deepfm_model(input_layers, dense_tensor, id_tensors, max_ids):
    linear_logit, deep_embeddings, dnn_input = _parts(dense_tensor, id_tensors, max_ids)
    dnn_logit = tf.keras.layers.Dense(1, use_bias=False)(DNN([8, 4], activation="relu")(dnn_input))
    factors = tf.reshape(tf.concat(deep_embeddings, 1), shape=(-1, len(deep_embeddings), 4))
    total = tf.reduce_sum(factors, axis=1)  # FM: half the square of the sum less the sum of the squares
    fm = 0.5 * tf.reduce_sum(tf.square(total) - tf.reduce_sum(tf.square(factors), axis=1), axis=1, keepdims=True)
    return _outputs(input_layers, tf.concat([linear_logit, dnn_logit, fm], 1), "deepfm")


def xdeepfm_model(input_layers, dense_tensor, id_tensors, max_ids):
    linear_logit, deep_embeddings, dnn_input = _parts(dense_tensor, id_tensors, max_ids)
    dnn_logit = tf.keras.layers.Dense(1, use_bias=False)(DNN([8, 4], activation="relu")(dnn_input))
    fields = len(deep_embeddings)
    factors = tf.reshape(tf.concat(deep_embeddings, 1), shape=(-1, fields, 4))
    # One compressed interaction layer: outer products of the field rows, summed by a 1x1 conv.
    interactions = tf.einsum("bfd,bgd->bfgd", factors, factors)
    cin = tf.keras.layers.Conv1D(4, 1)(tf.reshape(tf.transpose(interactions, [0, 3, 1, 2]), [-1, 4, fields * fields]))
    cin_logit = tf.keras.layers.Dense(1)(tf.reduce_sum(cin, axis=1))
    return _outputs(input_layers, tf.concat([linear_logit, dnn_logit, cin_logit], 1), "xdeepfm")


def dcn_model(input_layers, dense_tensor, id_tensors, max_ids):
    linear_logit, _, dnn_input = _parts(dense_tensor, id_tensors, max_ids)
    x0 = x = dnn_input
    for i in range(2):  # cross layers: x_{l+1} = x0 * (x_l . w) + x_l
        x = x0 * tf.keras.layers.Dense(1, use_bias=False, name=f"cross_w{i}")(x) + x
    deep_cross = tf.keras.layers.Dense(1, use_bias=False)(tf.concat([DNN([8, 4], activation="relu")(x0), x], 1))
    return _outputs(input_layers, tf.concat([linear_logit, deep_cross], 1), "dcn")


MODELS = {"wide_deep": wide_deep_model, "deepfm": deepfm_model, "xdeepfm": xdeepfm_model, "dcn": dcn_model}
