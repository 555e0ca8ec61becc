"""Written as the original's heart_functional_api.py is: numeric, bucketized, indicator and
embedding feature columns (tf.feature_column, local variables trained as dense parameters),
DenseFeatures on a dict of Inputs, CSV lines parsed in the dataset function."""

import tensorflow as tf

from elasticdl.python.common.constants import Mode

COLUMNS = ["age", "trestbps", "chol", "thal", "target"]


def get_feature_columns():
    age = tf.feature_column.numeric_column("age", dtype=tf.int64)
    thal = tf.feature_column.categorical_column_with_vocabulary_list("thal", ["fixed", "normal", "reversible"])
    return [
        tf.feature_column.numeric_column("trestbps", dtype=tf.int64),
        tf.feature_column.numeric_column("chol", dtype=tf.int64),
        tf.feature_column.bucketized_column(age, boundaries=[30, 40, 50, 60]),
        tf.feature_column.indicator_column(thal),
        tf.feature_column.embedding_column(thal, dimension=4),
    ]


def custom_model():
    inputs = {
        "age": tf.keras.layers.Input(name="age", shape=(1,), dtype=tf.int64),
        "trestbps": tf.keras.layers.Input(name="trestbps", shape=(1,), dtype=tf.int64),
        "chol": tf.keras.layers.Input(name="chol", shape=(1,), dtype=tf.int64),
        "thal": tf.keras.layers.Input(name="thal", shape=(1,), dtype=tf.string),
    }
    x = tf.keras.layers.DenseFeatures(get_feature_columns())(inputs)
    x = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.BatchNormalization()(x))
    y = tf.keras.layers.Dense(1, activation="sigmoid")(x)
    return tf.keras.Model(inputs=inputs, outputs=y)


def loss(labels, predictions):
    labels = tf.expand_dims(labels, axis=1)
    return tf.keras.losses.binary_crossentropy(labels, predictions)


def optimizer(lr=0.01):
    return tf.keras.optimizers.Adam(learning_rate=lr)


def dataset_fn(dataset, mode, _):
    def _parse_data(line):
        age, trestbps, chol, thal, target = tf.io.decode_csv(line, [[0], [0], [0], [""], [0]])
        features = {"age": tf.reshape(tf.cast(age, tf.int64), [1]),
                    "trestbps": tf.reshape(tf.cast(trestbps, tf.int64), [1]),
                    "chol": tf.reshape(tf.cast(chol, tf.int64), [1]), "thal": tf.reshape(thal, [1])}
        if mode == Mode.PREDICTION:
            return features
        return features, tf.cast(target, tf.float32)

    return dataset.map(_parse_data)


def eval_metrics_fn():
    return {"accuracy": lambda labels, predictions: tf.equal(
        tf.cast(tf.reshape(predictions, [-1]) > 0.5, tf.int32), tf.cast(tf.reshape(labels, [-1]), tf.int32))}
