"""Keras layers for ElasticDL jobs.

``elasticdl.layers.Embedding`` keeps its table on the parameter servers (rows sharded by
``id % num_ps``, created on first use); see docs/embeddings.md.
"""

from elasticdl.model.embedding.layer import Embedding

__all__ = ["Embedding"]
