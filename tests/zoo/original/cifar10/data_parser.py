"""Shared by the cifar10 modules (``from model_zoo.cifar10.data_parser import parse_data``)."""

import tensorflow as tf

from elasticdl.python.common.constants import Mode

SIZE = 16


def parse_data(record, mode):
    spec = {"image": tf.io.FixedLenFeature([SIZE, SIZE, 3], tf.float32)}
    if mode != Mode.PREDICTION:
        spec["label"] = tf.io.FixedLenFeature([1], tf.int64)
    r = tf.io.parse_single_example(record, spec)
    image = tf.cast(r["image"], tf.float32) / 255.0
    if mode == Mode.PREDICTION:
        return image
    return image, tf.cast(r["label"], tf.int32)


def dataset_fn(dataset, mode, _):
    dataset = dataset.map(lambda record: parse_data(record, mode))
    if mode == Mode.TRAINING:
        dataset = dataset.shuffle(buffer_size=256)
    return dataset


def loss(labels, predictions):
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        tf.reshape(labels, [-1]), predictions, from_logits=True))


def eval_metrics_fn():
    return {"accuracy": lambda labels, predictions: tf.equal(
        tf.argmax(predictions, 1, output_type=tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32))}
