"""The keras-io collaborative-filtering model, unedited: users x movies, 50-wide Keras
Embeddings with ``embeddings_regularizer=keras.regularizers.l2(1e-6)``, a dot product and
biases, a sigmoid, binary cross-entropy, Adam(0.001).

https://keras.io/examples/structured_data/collaborative_filtering_movielens/ . Under
``model.fit`` the tables are dense variables; ElasticDL's automatic swap
(--embedding_swap_threshold_mb) puts them on the parameter servers with their regularizer
(docs/embeddings.md, "Regularizers"). Records (``benchmarks/data.py``, kind "ratings"):
``ids`` = (user, movie), ``label`` = 0/1.
"""

import keras
import tensorflow as tf

from elasticdl import Mode

NUM_USERS, NUM_MOVIES = 50_000, 8_000
_FEATURES = {
    "ids": tf.io.FixedLenFeature([2], tf.int64),
    "label": tf.io.FixedLenFeature([1], tf.int64),
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


def custom_model(num_users=NUM_USERS, num_movies=NUM_MOVIES, embedding_size=50, l2=1e-6, l1=0.0):
    return RecommenderNet(num_users, num_movies, embedding_size, l2, l1, name="recommender")


def loss(labels, predictions):
    return tf.reduce_mean(keras.losses.binary_crossentropy(tf.reshape(labels, [-1, 1]), predictions))


def optimizer(lr=0.001):
    return keras.optimizers.Adam(learning_rate=lr)


def fast_optimizer():
    """--optimizer fast_optimizer: a few seconds of training on small data show learning (tests)."""
    return keras.optimizers.Adam(learning_rate=0.02)


def dataset_fn(dataset, mode, metadata):
    def parse(record):
        example = tf.io.parse_single_example(record, _FEATURES)
        if mode == Mode.PREDICTION:
            return example["ids"]
        return example["ids"], tf.cast(example["label"], tf.float32)

    return dataset.map(parse)
