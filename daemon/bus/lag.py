"""Consumer lag as the broker sees it: per input partition, messages after the group's committed offset.

This is the figure Kafka's own tools report (``kafka-consumer-groups --describe``), read with a
separate client so that the ingest thread's consumer is never touched from another thread. It
trails the daemon by up to the auto-commit interval (5 s), which is fine for alerting on a
daemon that has fallen behind or stopped consuming.

``KafkaLagProbe`` talks to the broker; ``MemoryLagProbe`` is its twin for the in-memory bus.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import KafkaSettings

Lag = dict[tuple[str, int], int]  # (topic, partition) -> messages behind


class LagProbe(Protocol):
    def read(self) -> Lag:
        """Lag of every partition of the input topics now; may block on the network for a few seconds."""
        ...

    def close(self) -> None: ...


class MemoryLagProbe:
    """Lag of a ``MemoryBus`` group: records in each topic after its committed position."""

    def __init__(self, bus: MemoryBus, topics: Sequence[str], group_id: str) -> None:
        self._bus = bus
        self._topics = tuple(topics)
        self._group = group_id

    def read(self) -> Lag:
        return {(t, 0): len(self._bus.read_all(t)) - self._bus.committed(self._group, t) for t in self._topics}

    def close(self) -> None:
        pass


class KafkaLagProbe:
    """Lag of consumer group ``group_id`` on ``topics`` (their ``partitions`` only, where named):
    high watermark minus committed offset.

    A partition the group has never committed counts from its low watermark (everything
    retained is unread). The probe's client is not a group member: it only reads offsets.
    """

    def __init__(
        self, settings: KafkaSettings, topics: Sequence[str], group_id: str, partitions: Sequence[int] | None = None
    ) -> None:
        from confluent_kafka import Consumer

        from hlb.daemon.bus.kafka import _client_config  # the one place client settings are assembled
        from hlb.daemon.bus.kafkalog import KafkaLog

        self._topics = tuple(topics)
        self._partitions = None if partitions is None else frozenset(partitions)
        # read() runs on a worker thread; close() must wait for it rather than pull the client away.
        self._lock = threading.Lock()
        self._closed = False
        self._consumer = Consumer(
            {**_client_config(settings), "group.id": group_id, "enable.auto.commit": False},
            logger=KafkaLog(),
        )

    def read(self) -> Lag:
        with self._lock:
            if self._closed:
                return {}
            return self._read()

    def _read(self) -> Lag:
        from confluent_kafka import TopicPartition

        metadata = self._consumer.list_topics(timeout=5.0).topics
        partitions = [
            TopicPartition(topic, partition)
            for topic in self._topics
            if topic in metadata and metadata[topic].error is None
            for partition in metadata[topic].partitions
            if self._partitions is None or partition in self._partitions
        ]
        if not partitions:
            return {}
        lag: Lag = {}
        for committed in self._consumer.committed(partitions, timeout=5.0):
            low, high = self._consumer.get_watermark_offsets(committed, timeout=5.0, cached=False)
            start = committed.offset if committed.offset >= 0 else low
            lag[(committed.topic, committed.partition)] = max(0, high - start)
        return lag

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._consumer.close()


# (topic, partition) -> (low, high) watermarks: the first retained offset and the next to be written.
Watermarks = dict[tuple[str, int], tuple[int, int]]


class EndOffsetProbe(Protocol):
    def read(self) -> Watermarks:
        """Watermarks of every partition of the topics now; may block on the network for a few seconds."""
        ...

    def close(self) -> None: ...


class MemoryEndOffsets:
    """Watermarks of ``MemoryBus`` topics (one partition each, nothing ever deleted)."""

    def __init__(self, bus: MemoryBus, topics: Sequence[str]) -> None:
        self._bus = bus
        self._topics = tuple(topics)

    def read(self) -> Watermarks:
        return {(t, 0): (0, len(self._bus.read_all(t))) for t in self._topics}

    def close(self) -> None:
        pass


class KafkaEndOffsets:
    """Watermarks of ``topics`` as the broker reports them, read with a client outside any group."""

    def __init__(self, settings: KafkaSettings, topics: Sequence[str]) -> None:
        import structlog
        from confluent_kafka import Consumer

        from hlb.daemon.bus.kafka import _client_config

        self._topics = tuple(topics)
        self._consumer = Consumer(
            {**_client_config(settings), "group.id": "hlb-watermarks", "enable.auto.commit": False},
            logger=structlog.stdlib.get_logger("librdkafka"),
        )

    def read(self) -> Watermarks:
        from confluent_kafka import TopicPartition

        from hlb.daemon.bus.kafka import _watermarks  # retries while a partition's leader settles

        metadata = self._consumer.list_topics(timeout=10.0).topics
        marks: Watermarks = {}
        for topic in self._topics:
            if topic not in metadata or metadata[topic].error is not None:
                continue
            for partition in metadata[topic].partitions:
                marks[(topic, partition)] = _watermarks(self._consumer, TopicPartition(topic, partition), 30.0)
        return marks

    def close(self) -> None:
        self._consumer.close()
