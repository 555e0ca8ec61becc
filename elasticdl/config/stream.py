"""The flags of a stream job: ``--training_data kafka://HOST:PORT/TOPIC`` (docs/online_training.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from elasticdl.config.errors import ConfigError
from elasticdl.config.fields import flag

STREAM_STARTS = ("earliest", "latest")
# The flags that make sense only for --training_data kafka://... (--window_records works for files too).
STREAM_ONLY = ("stream_idle_secs", "kafka_group", "export_every_secs")


@dataclass
class StreamSection:
    """How a job that trains on a Kafka stream starts and ends."""

    TITLE: ClassVar[str] = "Streams"

    stream_idle_secs: float = flag(
        0.0,
        "A stream job (--training_data kafka://HOST:PORT/TOPIC) ends once no new record came on any "
        "partition for this many seconds: the tasks cut so far are trained, then the job finishes as a "
        "file job does (0: it runs until stopped).",
        commands=("train",),
    )
    stream_start: str = flag(
        "earliest",
        "Where a new stream job starts in each partition: earliest (the first record the broker holds) "
        "or latest (only records that arrive after the start). A resumed job goes on from the offsets "
        "its ledger holds.",
        commands=("train",),
    )
    kafka_group: str = flag(
        "",
        "A stream job commits its consumed offsets to the brokers under this consumer group, so that "
        "standard lag monitors see the job: each partition's first offset not yet trained, about once a "
        "second and at the end. The job never reads them back: its ledger holds the truth ('': none).",
        commands=("train",),
    )
    export_every_secs: float = flag(
        0.0,
        "A stream job exports a SavedModel for serving every this many seconds while it trains, to "
        "--output/<model_version>/ (TensorFlow Serving's versioned layout; written under a temporary name "
        "and renamed), from one snapshot with every parameter server at the same version; the final "
        "export goes there too (0: only the final export, to --output itself).",
        commands=("train",),
    )
    keep_exports: int = flag(
        5,
        "With --export_every_secs: how many exports --output keeps (the newest; older ones are removed).",
        commands=("train",),
    )
    window_records: int = flag(
        0,
        "Progressive validation: each training batch is scored with eval_metrics_fn on the model "
        "before its gradients are pushed, and the scores are merged per window of this many records "
        "(whole tasks: a window closes at the first task report that reaches it), logged, written "
        "to TensorBoard and listed in report.json's progressive (0: off; costs a forward pass per batch).",
        commands=("train",),
    )

    def check(self, training_data: str, output: str = "") -> None:
        """The rules of these flags (``JobConfig.validate``)."""
        if self.stream_start not in STREAM_STARTS:
            raise ConfigError(f"--stream_start must be earliest or latest. Received: {self.stream_start!r}")
        if self.keep_exports < 1:
            raise ConfigError(f"--keep_exports must be 1 or more. Received: {self.keep_exports}")
        if not training_data.strip().lower().startswith("kafka://"):
            for name in STREAM_ONLY:
                if getattr(self, name):
                    raise ConfigError(
                        f"--{name} applies to a stream (--training_data kafka://HOST:PORT/TOPIC); "
                        f"--training_data {training_data!r} is files: drop --{name}"
                    )
        if self.export_every_secs and not output:
            raise ConfigError("--export_every_secs writes versioned exports to --output/<model_version>/: "
                              "set --output (a local or mounted directory)")
        if self.export_every_secs and "://" in output:
            raise ConfigError(f"--export_every_secs renames each export into place, which --output {output!r} "
                              "(an object store) cannot do: give a local or mounted directory")
