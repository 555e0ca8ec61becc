"""Written as the original's census wide & deep models with preprocessing layers are
(census_wide_deep_model, census_model_sqlflow/wide_and_deep): named Inputs in a dict, each
feature through a lookup, hash or bucketize layer (the lookup's table made in ``call``), the
ids of a group offset and concatenated, Keras Embeddings summed for the wide and the deep part,
a dict of outputs, ``learning_rate_scheduler``, and ``MaxStepsStopping`` among the callbacks."""

import tensorflow as tf
from model_zoo.census.census_process_layers import AddIdOffset, CategoryHash, CategoryLookup, NumericBucket

from elasticdl.python.elasticdl.callbacks import LearningRateScheduler, MaxStepsStopping

# (feature, transform, dtype, parameter): the original's FeatureInfo tuples, for our census data.
GROUPS = {
    "group1": [("workclass", "lookup", tf.string, ["private", "gov", "self"]),
               ("hours", "bucketize", tf.float32, [20, 30, 40, 50])],
    "group2": [("education", "hash", tf.string, 8), ("age", "bucketize", tf.float32, [25, 35, 50])],
}
WIDE, DEEP = ["group1", "group2"], ["group1", "group2"]


def _transform(kind, param):
    return {"lookup": CategoryLookup, "hash": CategoryHash, "bucketize": NumericBucket}[kind](param)


def _size(kind, param):
    return param if kind == "hash" else len(param) + 1


def custom_model():
    inputs = {name: tf.keras.layers.Input(name=name, shape=(1,), dtype=dtype)
              for group in GROUPS.values() for name, _, dtype, _ in group}
    ids, sizes = {}, {}
    for group_name, group in GROUPS.items():
        offsets = [0]
        for _, kind, _, param in group:
            offsets.append(offsets[-1] + _size(kind, param))
        items = [_transform(kind, param)(inputs[name]) for name, kind, _, param in group]
        ids[group_name] = tf.keras.layers.concatenate(AddIdOffset(offsets[:-1])(items), axis=-1)
        sizes[group_name] = offsets[-1]
    wide = [tf.keras.backend.sum(tf.keras.layers.Embedding(sizes[g], 1)(ids[g]), axis=1) for g in WIDE]
    deep = [tf.keras.backend.sum(tf.keras.layers.Embedding(sizes[g], 4)(ids[g]), axis=1) for g in DEEP]
    dnn = tf.reshape(deep, shape=(-1, len(DEEP) * 4))
    for units in (8, 4):
        dnn = tf.keras.layers.Dense(units)(dnn)
    logits = tf.reduce_sum(tf.concat([tf.keras.layers.Concatenate()(wide), dnn], 1), 1, keepdims=True)
    probs = tf.reshape(tf.sigmoid(logits), shape=(-1,))
    return tf.keras.Model(inputs=inputs, outputs={"logits": logits, "probs": probs}, name="wide_deep")


def loss(labels, predictions):
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, (-1, 1)), tf.float32), logits=predictions["logits"]))


def optimizer(lr=0.01):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def learning_rate_scheduler(model_version):
    return 0.01 if model_version < 1000 else 0.005


def callbacks():
    return [LearningRateScheduler(learning_rate_scheduler), MaxStepsStopping(max_steps=100000)]


def eval_metrics_fn():
    return {
        "logits": {"accuracy": lambda labels, predictions: tf.equal(
            tf.cast(tf.reshape(predictions, [-1]) > 0.0, tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32))},
        "probs": {"auc": tf.keras.metrics.AUC()},
    }


def dataset_fn(dataset, mode, _):
    def _parse_data(record):
        spec = {"workclass": tf.io.FixedLenFeature((1,), tf.string),
                "education": tf.io.FixedLenFeature((1,), tf.string),
                "age": tf.io.FixedLenFeature((1,), tf.float32), "hours": tf.io.FixedLenFeature((1,), tf.float32),
                "label": tf.io.FixedLenFeature([], tf.int64)}
        parsed = tf.io.parse_single_example(record, spec)
        label = parsed.pop("label")
        return parsed, label

    return dataset.map(_parse_data)
