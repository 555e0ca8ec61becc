"""The original's ``elasticdl.python.data`` paths (odps_io, reader.*): they import, so a model zoo
that imports them loads; what cannot work here refuses when used, naming the alternative."""
