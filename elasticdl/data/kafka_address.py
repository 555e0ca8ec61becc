"""Where a Kafka stream is: ``kafka://HOST:PORT[,HOST:PORT]/TOPIC``, and one partition of it.

A stream task's shard names one partition as ``kafka://HOST:PORT/TOPIC#PARTITION``, with its
start and end as offsets (elasticdl/data/sources.py ``Shard``): the ledger, the PS's data
positions (marks per task), fencing and rewinds see offsets where a file task has record
indices, and work unchanged. Pure text: no client is imported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticdl.data.errors import DataError

SCHEME = "kafka://"
_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")
# Kafka's own rule for a topic name.
_TOPIC = re.compile(r"^[A-Za-z0-9._\-]{1,249}$")


def is_kafka(spec: str) -> bool:
    """Does ``spec`` (a data flag's value, or a shard's path) name a Kafka stream?"""
    return spec.strip().lower().startswith(SCHEME)


@dataclass(frozen=True)
class KafkaAddress:
    """A topic on a cluster: the bootstrap brokers ("h1:9092,h2:9092") and the topic's name."""

    brokers: str
    topic: str

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.brokers}/{self.topic}"

    def partition_path(self, partition: int) -> str:
        """The path of a shard of ``partition``: ``kafka://brokers/topic#partition``."""
        return f"{self.url}#{partition}"


def parse_kafka_url(url: str, flag: str = "--training_data") -> KafkaAddress:
    """``kafka://HOST:PORT[,HOST:PORT]/TOPIC`` as a KafkaAddress; a DataError naming ``flag``
    and the expected form otherwise."""
    text = url.strip()
    rest = text[len(SCHEME):] if is_kafka(text) else ""
    brokers, _, topic = rest.partition("/")
    hosts = [h.strip() for h in brokers.split(",")]
    if not rest or not all(_HOST_PORT.match(h) for h in hosts) or not _TOPIC.match(topic):
        raise DataError(
            f"{flag} {url!r} is not a Kafka stream address: use kafka://HOST:PORT[,HOST:PORT]/TOPIC "
            "(e.g. kafka://127.0.0.1:9092/clicks; a topic name is letters, digits, '.', '_' and '-')"
        )
    return KafkaAddress(",".join(hosts), topic)


def stream_of(path: str) -> str:
    """The stream a shard path belongs to (``kafka://brokers/topic`` of ``...#partition``); a
    file's path as it is."""
    return path.rpartition("#")[0] if is_kafka(path) and "#" in path else path


def parse_partition_path(path: str) -> tuple[KafkaAddress, int]:
    """(address, partition) of a shard path ``kafka://brokers/topic#partition``."""
    url, sep, partition = path.rpartition("#")
    if not sep or not partition.isdigit():
        raise DataError(f"{path!r} names no partition of a Kafka topic (kafka://HOST:PORT/TOPIC#PARTITION)")
    return parse_kafka_url(url, "a stream task's path"), int(partition)
