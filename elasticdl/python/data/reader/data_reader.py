"""``AbstractDataReader``, ``Metadata`` and ``check_required_kwargs`` (the original's path).

Subclassing works, so a module that defines a reader class imports; constructing one refuses:
ElasticDL cuts the files of --training_data into tasks and reads them itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticdl.python.data.refusals import FILE_READ, refuse


@dataclass
class Metadata:
    """What a reader told dataset_fn about the records (the original's ``metadata`` argument)."""

    column_names: list[str] | None = None
    column_dtypes: dict = field(default_factory=dict)


def check_required_kwargs(required_args, kwargs) -> None:
    missing = [name for name in required_args if name not in kwargs]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)}")


class AbstractDataReader:
    """The original's reader interface (``read_records``, ``create_shards``, ``metadata``)."""

    # The message a subclass's construction raises; the ODPS readers name ODPS's alternative.
    _refusal = FILE_READ

    def __init__(self, *args, **kwargs):
        raise refuse(self._refusal, type(self).__name__)

    def read_records(self, task):
        raise NotImplementedError

    def create_shards(self):
        raise NotImplementedError

    @property
    def records_output_types(self):
        raise NotImplementedError

    @property
    def metadata(self):
        return Metadata()


__all__ = ["AbstractDataReader", "Metadata", "check_required_kwargs"]
