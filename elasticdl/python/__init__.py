"""Compatibility package: model-zoo files written for the original ElasticDL import from here."""
