"""Submit-time checks of a Kafka stream (elasticdl/master/preflight.py calls them): the brokers
answer, the topic exists, and it holds a first batch for the check of ``dataset_fn`` and the model."""

from __future__ import annotations

from elasticdl.data.errors import DataError
from elasticdl.data.kafka_client import KafkaTopic


def check_stream(flag: str, url: str, command: str) -> list[tuple[str, int]]:
    """``[(url, 0)]`` for a reachable topic (a stream has no record count; the job's fingerprint
    names the stream alone); a DataError naming ``flag`` otherwise."""
    if command != "train":
        raise DataError(f"{flag}: `elasticdl {command}` reads files; a Kafka stream ({url}) is for `elasticdl train`")
    topic = KafkaTopic.of(url, flag)
    topic.partitions(flag)
    return [(topic.address.url, 0)]


def sample_stream(url: str, n: int) -> list[bytes]:
    """The first ``n`` records of the stream, for the one-batch check; a DataError when it has none."""
    topic = KafkaTopic.of(url, keep_consumers=False)  # the master's process: see kafka_client._fetching
    records = topic.sample(n)
    if not records:
        raise DataError(
            f"--training_data: the topic {topic.address.topic!r} holds no record yet, and the submit check runs "
            "one batch through dataset_fn and the model: produce at least one record, then submit"
        )
    return records
