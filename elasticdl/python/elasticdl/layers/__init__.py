"""The original ElasticDL's ``elasticdl.python.elasticdl.layers`` package."""
