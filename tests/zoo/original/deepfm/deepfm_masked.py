"""Written as the original's deepfm_functional_api.py is in its Keras 2 form: an *unnamed*
``tf.keras.Input`` (Keras calls it ``input_1``) fed the dict ``{"feature": ...}`` that
dataset_fn returns, as tf.keras 2 fed it (a dict whose keys name no Input is taken in key
order); masked Embeddings with a custom mask layer, ``tensorflow.keras.backend`` ops, the
two-argument ``dataset_fn(dataset, mode)``, a dict of outputs."""

import tensorflow as tf
import tensorflow.keras.backend as K
from tensorflow.keras.layers import Dense, Embedding, Flatten, Layer, Multiply, Subtract

from elasticdl.python.common.constants import Mode

LENGTH = 5


class ZeroMasked(Layer):
    """Zeroes the embeddings of padding ids (the mask of ``mask_zero=True``), then drops the mask."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def compute_mask(self, inputs, mask=None):
        return None

    def call(self, x, mask=None):
        return Multiply()([x, tf.cast(K.expand_dims(mask, -1), tf.float32)])


def custom_model(input_dim=64, embedding_dim=4, fc_unit=8):
    inputs = tf.keras.Input(shape=(LENGTH,))
    factors = ZeroMasked()(Embedding(input_dim, embedding_dim, mask_zero=True)(inputs))
    total = K.sum(factors, axis=1)
    second_order = K.sum(0.5 * Subtract()([K.square(total), K.sum(K.square(factors), axis=1)]), axis=1)
    first_order = K.sum(ZeroMasked()(Embedding(input_dim, 1, mask_zero=True)(inputs)), axis=(1, 2))
    deep = tf.reshape(Dense(1)(Dense(fc_unit)(Flatten()(factors))), shape=(-1,))
    logits = tf.keras.layers.Add()([first_order, second_order, deep])
    return tf.keras.Model(inputs=inputs, outputs={"logits": logits, "probs": tf.sigmoid(logits)})


def loss(labels, predictions):
    labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
    logits = tf.reshape(predictions["logits"], [-1])
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(logits=logits, labels=labels))


def optimizer(lr=0.1):
    return tf.optimizers.SGD(lr)


def dataset_fn(dataset, mode):
    def _parse_data(record):
        spec = {"feature": tf.io.FixedLenFeature([LENGTH], tf.int64)}
        if mode != Mode.PREDICTION:
            spec["label"] = tf.io.FixedLenFeature([1], tf.int64)
        r = tf.io.parse_single_example(record, spec)
        features = {"feature": tf.cast(r["feature"], tf.float32)}
        if mode == Mode.PREDICTION:
            return features
        return features, tf.cast(r["label"], tf.int32)

    return dataset.map(_parse_data)


def eval_metrics_fn():
    return {
        "logits": {"accuracy": lambda labels, predictions: tf.equal(
            tf.cast(tf.reshape(predictions, [-1]) > 0.0, tf.int32), tf.reshape(labels, [-1]))},
        "probs": {"auc": tf.keras.metrics.AUC()},
    }
