"""The messages of the original's data pieces that cannot work here: each names the alternative."""

from __future__ import annotations

from elasticdl.errors import UserError


class UnsupportedDataReader(UserError, NotImplementedError):
    """A data reader or writer of the original ElasticDL was used; ElasticDL reads files itself."""


ODPS_READ = (
    "{what}: ElasticDL reads no ODPS (MaxCompute) table. Export the table to TFRecord or Parquet "
    "files (for example with PyODPS's tunnel download or a Spark job), pass them with --training_data "
    "(--validation_data, --prediction_data), and parse the columns in dataset_fn "
    "(docs/model_zoo.md#migrating-from-the-original-elasticdl)."
)
ODPS_WRITE = (
    "{what}: ElasticDL writes no ODPS (MaxCompute) table. elasticdl predict writes predictions.csv "
    "under --prediction_outputs (upload it with ODPS's tunnel upload), or write the rows yourself in "
    "PredictionOutputsProcessor.process with a client you install (docs/model_zoo.md#predictionoutputsprocessor-optional)."
)
FILE_READ = (
    "{what}: ElasticDL reads TFRecord, RecordIO, CSV and Parquet files itself and cuts them into tasks; "
    "a custom data reader is not used. Pass the files with --training_data (--validation_data, "
    "--prediction_data) and parse each record in dataset_fn "
    "(docs/model_zoo.md#migrating-from-the-original-elasticdl)."
)


def refuse(template: str, what: str) -> UnsupportedDataReader:
    return UnsupportedDataReader(template.format(what=what))
