"""Written as the original's deepfm_edl_embedding.py is: the original's Embedding path (rows on
the PS), a masking layer, tf.keras.backend and raw TF ops on Keras tensors, a dict of outputs,
nested eval_metrics_fn that gets the labels tensor for each output."""

import tensorflow as tf
import tensorflow.keras.backend as K
from tensorflow.keras.layers import Dense, Flatten, Layer, Multiply, Subtract

from elasticdl.python.common.constants import Mode
from elasticdl.python.elasticdl.layers.embedding import Embedding


class ApplyMask(Layer):
    def __init__(self, **kwargs):
        self.supports_masking = True
        super(ApplyMask, self).__init__(**kwargs)

    def compute_mask(self, input, input_mask=None):
        return None

    def call(self, x, mask=None):
        return Multiply()([x, tf.cast(K.expand_dims(mask, -1), tf.float32)])


def custom_model(embedding_dim=4, input_length=5, fc_unit=8):
    inputs = tf.keras.Input(shape=(input_length,), name="feature")
    embeddings = Embedding(output_dim=embedding_dim, mask_zero=True, input_length=input_length)(inputs)
    embeddings = ApplyMask()(embeddings)
    emb_sum = K.sum(embeddings, axis=1)
    second_order = K.sum(0.5 * Subtract()([K.square(emb_sum), K.sum(K.square(embeddings), axis=1)]), axis=1)
    id_bias = ApplyMask()(Embedding(output_dim=1, mask_zero=True)(inputs))
    first_order = K.sum(id_bias, axis=(1, 2))
    fm_output = tf.keras.layers.Add()([first_order, second_order])
    deep_output = tf.reshape(Dense(1)(Dense(fc_unit)(Flatten()(embeddings))), shape=(-1,))
    logits = tf.keras.layers.Add()([fm_output, deep_output])
    probs = tf.sigmoid(logits)
    return tf.keras.Model(inputs=inputs, outputs={"logits": logits, "probs": probs})


def loss(labels, predictions):
    logits = tf.reshape(predictions["logits"], [-1])
    labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(logits=logits, labels=labels))


def optimizer(lr=0.1):
    return tf.optimizers.SGD(lr)


def dataset_fn(dataset, mode, _):
    def _parse_data(record):
        spec = {"feature": tf.io.FixedLenFeature([5], tf.int64)}
        if mode != Mode.PREDICTION:
            spec["label"] = tf.io.FixedLenFeature([1], tf.int64)
        r = tf.io.parse_single_example(record, spec)
        features = {"feature": r["feature"]}
        if mode == Mode.PREDICTION:
            return features
        return features, tf.cast(r["label"], tf.int32)

    return dataset.map(_parse_data)


def eval_metrics_fn():
    return {
        "logits": {
            "accuracy": lambda labels, predictions: tf.equal(
                tf.cast(tf.reshape(predictions, [-1]) > 0.0, tf.int32), tf.reshape(labels, [-1])
            ),
        },
        "probs": {"auc": tf.keras.metrics.AUC()},
    }
