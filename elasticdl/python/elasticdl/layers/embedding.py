"""``from elasticdl.python.elasticdl.layers.embedding import Embedding`` (the original's path):
``elasticdl.layers.Embedding``, its table on the parameter servers, for the Keras the module
runs on (a ``tf_keras`` layer under Keras 2, see elasticdl/model/keras_generation.py)."""

from elasticdl.model.keras_generation import legacy_active

if legacy_active():
    from elasticdl.model.embedding.keras2_layer import Embedding
else:
    from elasticdl.model.embedding.layer import Embedding

__all__ = ["Embedding"]
