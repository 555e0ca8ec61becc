"""Compatibility package (see elasticdl.python.common.constants)."""
