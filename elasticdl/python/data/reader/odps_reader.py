"""``ODPSDataReader`` (the original's path): importable; constructing it refuses and says how to
train on the table's rows (export them to TFRecord or Parquet files)."""

from elasticdl.python.data.reader.data_reader import AbstractDataReader
from elasticdl.python.data.refusals import ODPS_READ


class ODPSDataReader(AbstractDataReader):
    _refusal = ODPS_READ


__all__ = ["ODPSDataReader"]
