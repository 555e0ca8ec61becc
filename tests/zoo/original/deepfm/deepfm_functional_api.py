"""Written as the original's deepfm_functional_api.py is: tf.keras Embedding tables for the
first- and second-order terms and the deep part, raw TF ops on Keras tensors, a dict of outputs
(logits, probs), nested metrics, Adam."""

import tensorflow as tf

from elasticdl.python.common.constants import Mode


def custom_model(input_dim=64, embedding_dim=4, input_length=5, fc_unit=8):
    inputs = tf.keras.Input(shape=(input_length,), name="feature", dtype=tf.int64)
    embeddings = tf.keras.layers.Embedding(input_dim, embedding_dim, name="factors")(inputs)
    emb_sum = tf.reduce_sum(embeddings, axis=1)
    second_order = 0.5 * tf.reduce_sum(tf.square(emb_sum) - tf.reduce_sum(tf.square(embeddings), axis=1), axis=1)
    first_order = tf.reduce_sum(tf.keras.layers.Embedding(input_dim, 1, name="linear")(inputs), axis=(1, 2))
    deep = tf.keras.layers.Dense(fc_unit, activation="relu")(tf.keras.layers.Flatten()(embeddings))
    deep_output = tf.reshape(tf.keras.layers.Dense(1)(deep), [-1])
    logits = first_order + second_order + deep_output
    return tf.keras.Model(inputs=inputs, outputs={"logits": logits, "probs": tf.sigmoid(logits)}, name="deepfm")


def loss(labels, predictions):
    labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(logits=predictions["logits"], labels=labels))


def optimizer(lr=0.01):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def dataset_fn(dataset, mode, _):
    def _parse_data(record):
        r = tf.io.parse_single_example(record, {"feature": tf.io.FixedLenFeature([5], tf.int64),
                                                "label": tf.io.FixedLenFeature([1], tf.int64)})
        if mode == Mode.PREDICTION:
            return r["feature"]
        return r["feature"], r["label"]

    return dataset.map(_parse_data)


def eval_metrics_fn():
    return {"probs": {"auc": tf.keras.metrics.AUC()}}
