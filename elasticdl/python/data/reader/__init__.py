"""The original's ``elasticdl.python.data.reader`` package: its readers import, and refuse when
constructed (ElasticDL reads the files itself; see elasticdl/python/data/refusals.py)."""
