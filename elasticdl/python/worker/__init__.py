"""The original ElasticDL's ``elasticdl.python.worker`` package (prediction_outputs_processor)."""
