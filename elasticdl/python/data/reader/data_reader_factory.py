"""``create_data_reader`` (the original's path): refuses, naming the alternative for the data it
was asked to read (an ODPS table when ODPS is configured, files otherwise)."""

from __future__ import annotations

from elasticdl.python.data.odps_io import is_odps_configured
from elasticdl.python.data.reader.csv_reader import CSVDataReader
from elasticdl.python.data.reader.odps_reader import ODPSDataReader
from elasticdl.python.data.reader.recordio_reader import RecordIODataReader


def create_data_reader(data_origin=None, records_per_task=None, **kwargs):
    if is_odps_configured():
        return ODPSDataReader(data_origin=data_origin, **kwargs)
    if str(data_origin or "").endswith(".csv"):
        return CSVDataReader(data_origin=data_origin, **kwargs)
    return RecordIODataReader(data_dir=data_origin, **kwargs)


__all__ = ["create_data_reader"]
