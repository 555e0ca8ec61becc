"""The original ElasticDL's ``elasticdl.python.elasticdl`` paths: callbacks, layers, feature_column."""
