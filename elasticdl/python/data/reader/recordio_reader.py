"""``RecordIODataReader`` (the original's path): importable and subclassable; constructing it refuses, since
ElasticDL reads RecordIO files itself (pass them with --training_data)."""

from elasticdl.python.data.reader.data_reader import AbstractDataReader


class RecordIODataReader(AbstractDataReader):
    pass


__all__ = ["RecordIODataReader"]
