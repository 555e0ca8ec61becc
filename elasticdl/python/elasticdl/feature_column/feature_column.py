"""``feature_column.embedding_column(categorical_column, dimension, combiner)``: the original
ElasticDL's embedding column, its table on the parameter servers (sharded by id), for
``tf.keras.layers.DenseFeatures`` under Keras 2. See elasticdl/model/embedding/keras2_layer.py."""

from elasticdl.model.embedding.keras2_layer import embedding_column

__all__ = ["embedding_column"]
