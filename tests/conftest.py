"""Shared fixtures."""

from etcd_fixture import etcd_process, etcd_server  # noqa: F401  (pytest finds fixtures by name)
