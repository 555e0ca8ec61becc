"""Record readers (TFRecord, CSV, Parquet) and task shards; TensorFlow-free."""

from elasticdl.data.errors import BadRecord, BadRecordError, CorruptRecordError, DataError, NoDataFilesError
from elasticdl.data.sources import (
    Shard,
    count_records,
    make_shards,
    read_records,
    record_format,
    resolve_data_files,
)
from elasticdl.data.tfrecord import write_records

__all__ = [
    "BadRecord",
    "BadRecordError",
    "CorruptRecordError",
    "DataError",
    "NoDataFilesError",
    "Shard",
    "count_records",
    "make_shards",
    "read_records",
    "record_format",
    "resolve_data_files",
    "write_records",
]
