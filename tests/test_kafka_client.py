"""The Kafka source's client side against a real broker (Tansu, tests/kafka_fixture.py): the
submit checks, a task's offset range, and the partitions' ends read past the watermark."""

from __future__ import annotations

import pytest
from kafka_fixture import _free_port, kafka_broker  # noqa: F401  (pytest finds fixtures by name)

from elasticdl.data.errors import DataError
from elasticdl.data.kafka_address import is_kafka, parse_kafka_url, parse_partition_path
from elasticdl.data.kafka_client import KafkaTopic


def test_addresses_parse_and_name_the_form_when_they_do_not():
    address = parse_kafka_url("kafka://127.0.0.1:9092, broker-2:9093/clicks.v1")
    assert (address.brokers, address.topic) == ("127.0.0.1:9092,broker-2:9093", "clicks.v1")
    assert parse_partition_path(address.partition_path(3)) == (address, 3)
    assert is_kafka("KAFKA://h:1/t") and not is_kafka("data/digits/train")
    for bad in ("kafka://h:1", "kafka://h/t", "kafka://h:1/bad topic", "kafka:///t"):
        with pytest.raises(DataError, match=r"--training_data .* kafka://HOST:PORT\[,HOST:PORT\]/TOPIC"):
            parse_kafka_url(bad)


def test_an_unreachable_broker_is_named_with_the_flag():
    topic = KafkaTopic.of(f"kafka://127.0.0.1:{_free_port()}/t")
    with pytest.raises(DataError, match=r"--training_data: the Kafka brokers 127\.0\.0\.1:\d+ cannot be reached"):
        topic.partitions(timeout=1.5)


def test_a_missing_topic_is_named_and_not_created(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("present", 1)
    topic = KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/absent")
    with pytest.raises(DataError, match=r"the topic 'absent' does not exist .*topics there: present"):
        topic.partitions()
    with pytest.raises(DataError, match="does not exist"):  # asking did not create it
        topic.partitions()


def test_a_range_reads_exactly_its_offsets_and_the_ends_go_past_an_under_reported_watermark(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("digits", 2)
    n = 6000
    kafka_broker.produce("digits", (b"record-%d" % i for i in range(n)), partitions=2)
    topic = KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/digits")
    assert topic.partitions() == [0, 1]
    # Partition 0 holds the even records, at offsets 0 .. 2999.
    assert topic.read(0, 10, 13) == [b"record-20", b"record-22", b"record-24"]
    assert topic.read(1, 2998, 3000) == [b"record-5997", b"record-5999"]
    assert topic.read(0, 5, 5) == []
    # The watermark may under-report (Tansu does when producers batch); a probe reads past it.
    ends = {}
    for partition in (0, 1):
        _low, high = topic.watermarks(partition)
        assert high <= n // 2
        ends[partition] = topic.probe({partition: high}, limit=n)[partition] if high < n // 2 else high
    assert ends == {0: n // 2, 1: n // 2}
    # Nothing past the end: the probe answers where it started.
    assert topic.probe({0: n // 2, 1: n // 2}, limit=10, wait=0.2) == {0: n // 2, 1: n // 2}
    assert topic.sample(4) == [b"record-0", b"record-2", b"record-4", b"record-6"]


def test_a_range_past_what_the_partition_holds_fails_after_its_timeout(kafka_broker):  # noqa: F811
    kafka_broker.create_topic("short", 1)
    kafka_broker.produce("short", [b"a", b"b"])
    topic = KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/short")
    with pytest.raises(DataError, match=r"short#0 offsets 1-4: only 1 of 4 records arrived within 1 s"):
        topic.read(0, 1, 5, timeout=1.0)


def test_a_records_kafka_timestamp_is_read_at_its_offset(kafka_broker):  # noqa: F811
    from confluent_kafka import Producer

    kafka_broker.create_topic("stamped", 2)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    for i in range(6):  # CreateTime set by the producer: 1,700,000,000 s + i on partition i % 2
        producer.produce("stamped", value=b"%d" % i, partition=i % 2, timestamp=1_700_000_000_000 + 1000 * i)
    assert producer.flush(30) == 0
    topic = KafkaTopic.of(f"kafka://{kafka_broker.bootstrap}/stamped")
    assert topic.timestamps({0: 2, 1: 1}) == {0: 1_700_000_004.0, 1: 1_700_000_003.0}
    assert topic.timestamps({0: 50}, timeout=0.5) == {}  # not there (yet): left out


def test_the_masters_fetch_helper_dies_with_it_and_leaves_no_pipe_open():
    """The helper process (kafka_client.FetchHelper) of a master SIGKILLed must not live on
    holding the master's stdout and stderr: whoever waits for their end (a test, a shell)
    would wait for ever. It did before it asked Linux to kill it with its parent."""
    import subprocess
    import sys

    code = ("import time\nfrom elasticdl.data.kafka_client import FetchHelper\n"
            "print(FetchHelper().call(abs, -3), flush=True)\ntime.sleep(600)\n")
    master = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert master.stdout.readline().strip() == "3"  # the helper answered: it runs
        master.kill()
        out, _ = master.communicate(timeout=30)  # the pipes' end: no process holds them any more
    finally:
        if master.poll() is None:
            master.kill()
    assert master.returncode == -9 and out == ""
