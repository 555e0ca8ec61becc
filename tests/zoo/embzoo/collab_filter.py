"""The keras-io collaborative-filtering example's model (users x items, L2-regularized Keras
Embeddings, a dot product and biases), unedited apart from its sizes, and synthetic ratings.

https://keras.io/examples/structured_data/collaborative_filtering_movielens/ : plain
``keras.layers.Embedding`` with ``embeddings_regularizer=keras.regularizers.l2(1e-6)``; the
automatic swap puts its tables on the parameter servers.
"""

import os

import keras
import numpy as np
import tensorflow as tf

from elasticdl import Mode

_FEATURES = {
    "pair": tf.io.FixedLenFeature([2], tf.int64),
    "rating": tf.io.FixedLenFeature([1], tf.float32),
}


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, l2=1e-6, l1=0.0, **kwargs):
        super().__init__(**kwargs)
        # keras-io's regularizer; with l1 (the tests of L1) an L1L2 one.
        regularizer = keras.regularizers.L1L2(l1=l1, l2=l2) if l1 else keras.regularizers.l2(l2)
        self.user_embedding = keras.layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=regularizer, name="users",
        )
        self.user_bias = keras.layers.Embedding(num_users, 1, name="user_bias")
        self.movie_embedding = keras.layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=regularizer, name="movies",
        )
        self.movie_bias = keras.layers.Embedding(num_movies, 1, name="movie_bias")

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = keras.ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot_user_movie + user_bias + movie_bias
        return keras.ops.nn.sigmoid(x)


def custom_model(num_users=500, num_movies=200, embedding_size=50, l2=1e-6, l1=0.0):
    return RecommenderNet(num_users, num_movies, embedding_size, l2, l1, name="recommender")


def loss(labels, predictions):
    return tf.reduce_mean(keras.losses.binary_crossentropy(tf.reshape(labels, [-1, 1]), predictions))


def optimizer(lr=0.001):
    return keras.optimizers.Adam(learning_rate=lr)


def fast_optimizer():
    """--optimizer fast_optimizer: a few seconds of training on small data show learning."""
    return keras.optimizers.Adam(learning_rate=0.02)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        if mode == Mode.PREDICTION:
            return example["pair"]
        return example["pair"], example["rating"]

    return dataset.map(parse)


def generate(output: str, records: int, num_users: int = 500, num_movies: int = 200, seed: int = 0) -> None:
    """Ratings in [0, 1] from hidden 4-wide user and item factors, as TFRecord files under
    ``output``/train and ``output``/test (one file each)."""
    rng = np.random.default_rng(seed)
    users, movies = rng.normal(size=(num_users, 4)), rng.normal(size=(num_movies, 4))
    for split, count in (("train", records), ("test", max(1, records // 4))):
        os.makedirs(os.path.join(output, split), exist_ok=True)
        pairs = np.stack([rng.integers(0, num_users, count), rng.integers(0, num_movies, count)], axis=1)
        ratings = 1 / (1 + np.exp(-(users[pairs[:, 0]] * movies[pairs[:, 1]]).sum(axis=1)))
        with tf.io.TFRecordWriter(os.path.join(output, split, "data-0.tfrecord")) as writer:
            for pair, rating in zip(pairs, ratings):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "pair": tf.train.Feature(int64_list=tf.train.Int64List(value=pair.tolist())),
                    "rating": tf.train.Feature(float_list=tf.train.FloatList(value=[float(rating)])),
                }))
                writer.write(example.SerializeToString())
