"""Run by test_embedding_regularizer.py in a fresh process: Keras 2 (tf_keras) must be chosen
before TensorFlow is imported. Prints one line of JSON."""

import json
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from elasticdl.model.embedding.backends import EmbeddingTables, recording, use_embedding_backend  # noqa: E402
from elasticdl.model.embedding.keras2_layer import Embedding  # noqa: E402

backend = EmbeddingTables()
with use_embedding_backend(backend):
    ids = tf_keras.Input(shape=(2,), dtype="int64")
    model = tf_keras.Model(ids, Embedding(3, input_dim=10, embeddings_regularizer=tf_keras.regularizers.L2(0.5),
                                          name="e")(ids))
x = tf.constant([[1, 1], [2, 5]], tf.int64)
with tf.GradientTape() as tape, recording(tape) as recorder:
    model(x, training=True)
    loss = tf.add_n(model.losses)
rows = backend.source.tables["e/embeddings"].lookup(np.array([1, 2, 5]), False)
grad = tape.gradient(loss, recorder.sources)[0].numpy()
local = Embedding(3, input_dim=10, embeddings_regularizer="l1")
local(x)
restored = Embedding.from_config(local.get_config())
print(json.dumps({
    "penalty": float(loss), "expected_penalty": float(0.5 * (rows**2).sum()),
    "gradient_error": float(np.abs(grad - rows).max()),  # 2 * 0.5 * row
    "local_penalty": float(tf.add_n(local.losses)), "expected_local": float(0.01 * np.abs(local.embeddings.numpy()).sum()),
    "restored_l1": restored._regularizer.l1,
}))
