"""SparseEmbedding: the combined embedding of each row's ids, for sparse id tensors."""

from __future__ import annotations

import tensorflow as tf

from elasticdl_preprocessing.layers.base import PreprocessingLayer

_COMBINERS = ("sum", "mean", "sqrtn")


class SparseEmbedding(PreprocessingLayer):
    """Looks up the rows of an ``(input_dim, output_dim)`` table for the ids of each example and
    combines them (``combiner``: ``"mean"`` by default, ``"sum"`` or ``"sqrtn"``) into one
    ``(batch, output_dim)`` vector; an example without ids gets zeros. The ids come as a
    ``tf.SparseTensor`` (``ToSparse``, ``ConcatenateWithOffset`` of sparse ids), or dense, where
    0 is padding, as in the original.

    >>> SparseEmbedding(input_dim=10, output_dim=4)(tf.sparse.from_dense([[1, 2], [3, 0]]))  # (2, 4)
    """

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer="uniform", combiner: str = "mean",
                 **kwargs):
        if combiner not in _COMBINERS:
            raise ValueError(f"SparseEmbedding: `combiner` must be one of {_COMBINERS}. Received: combiner={combiner!r}")
        super().__init__(**kwargs)
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.embeddings_initializer = tf.keras.initializers.get(embeddings_initializer)
        self.combiner = combiner

    def build(self, input_shape):
        self.embeddings = self.add_weight(name="embeddings", shape=(self.input_dim, self.output_dim),
                                          initializer=self.embeddings_initializer, trainable=True)
        self.built = True

    def call(self, inputs):
        if not isinstance(inputs, tf.SparseTensor):
            if isinstance(inputs, tf.RaggedTensor):
                inputs = inputs.to_sparse()
            else:
                inputs = tf.convert_to_tensor(inputs)
                keep = tf.where(tf.not_equal(inputs, tf.zeros_like(inputs)))
                inputs = tf.SparseTensor(keep, tf.gather_nd(inputs, keep), tf.shape(inputs, out_type=tf.int64))
        if inputs.values.dtype not in (tf.int32, tf.int64):
            inputs = inputs.with_values(tf.cast(inputs.values, tf.int64))
        # Examples without ids get zeros (the safe lookup), as the original's did.
        return tf.nn.safe_embedding_lookup_sparse(tf.convert_to_tensor(self.embeddings), inputs, combiner=self.combiner)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.output_dim)

    def get_config(self) -> dict:
        return {**super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim,
                "embeddings_initializer": tf.keras.initializers.serialize(self.embeddings_initializer),
                "combiner": self.combiner}
