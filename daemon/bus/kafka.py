"""The Kafka implementation of the bus seam (confluent-kafka / librdkafka).

The consumer runs on the ingest thread only. Offsets are stored by hand after a batch has been
applied (``enable.auto.offset.store=false``) and committed in the background, which gives
at-least-once delivery. The offsets that count for recovery are the ones in the daemon's own
snapshot (``hlb.daemon.record.snapshot``): an assigned partition starts at the snapshot's offset when a
snapshot covers it, else at its earliest retained record; the group's committed offsets only
show progress to lag tools. Consumer lag per partition comes from librdkafka's statistics
(``statistics.interval.ms`` and ``stats_cb``), served on the ingest thread inside ``consume``.

Every client gets ``message.max.bytes`` from the settings (``record_max_bytes``): librdkafka refuses
to produce a record bigger than it, and its default (1,000,000 bytes) is below the events hlb
accepts (``kafka.max_event_bytes``), so the copy of a big refused record could not have gone to
the dead-letter topic.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import structlog
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from hlb.daemon.bus.kafkalog import FoldedLog, KafkaLog
from hlb.daemon.bus.seam import Offsets, RawEvent
from hlb.daemon.config import KafkaSettings
from hlb.daemon.errors import BrokerError

log = structlog.get_logger(__name__)


ClientConfig = dict[str, str | int | float | bool]

FETCH_QUEUE_BACKOFF_MS = 10  # see KafkaSource: how soon a full prefetch queue is looked at again
# The ledger (the placements topic) is read back at every start: it keeps every record. Compaction
# would keep one per key, the cell (hlb.daemon.bus.topics says what each topic must keep).
LEDGER_CONFIG = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
# How long ensure_topics waits for a first answer from the bootstrap servers before it says none came.
CONNECT_TIMEOUT_S = 5.0


def _client_config(settings: KafkaSettings) -> ClientConfig:
    # message.max.bytes is a producer's limit; a consumer only raises its fetch.max.bytes to it.
    config: ClientConfig = {
        "bootstrap.servers": settings.bootstrap_servers,
        "message.max.bytes": settings.record_max_bytes,
    }
    config.update({key: value.get_secret_value() for key, value in settings.client_config.items()})
    return config


def _raw(message: Message) -> RawEvent:
    return RawEvent(
        message.topic() or "",
        message.partition() or 0,
        message.offset() or 0,
        _bytes(message.key()),
        _bytes(message.value()),
        _headers(message.headers()),
    )


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _headers(raw: object) -> tuple[tuple[str, bytes], ...]:
    if not raw:
        return ()
    pairs = raw.items() if isinstance(raw, dict) else raw
    assert isinstance(pairs, Iterable)
    return tuple((k, v.encode() if isinstance(v, str) else v or b"") for k, v in pairs)


_new_raw = partial(tuple.__new__, RawEvent)
_M = Message


def _raws(messages: list[Message]) -> list[RawEvent]:
    """``_raw`` of every message (none with an error), in C-level loops: this runs per record consumed."""
    ms = messages
    keys, values, headers = list(map(_M.key, ms)), list(map(_M.value, ms)), list(map(_M.headers, ms))
    if not _PLAIN_TYPES.issuperset(map(type, keys)) or not _PLAIN_TYPES.issuperset(map(type, values)):
        return [_raw(m) for m in ms]  # text keys or values: only from a client configured to give them
    plain = headers.count(None) == len(ms)
    fields = zip(
        map(_M.topic, ms), map(_M.partition, ms), map(_M.offset, ms), keys, values,
        itertools.repeat(()) if plain else map(_headers, headers),
        strict=False,  # the repeat is endless; the maps over ms set the length
    )  # fmt: skip
    return list(map(_new_raw, fields))


_PLAIN_TYPES = frozenset({bytes, type(None)})


def parse_lag(stats_json: str) -> dict[tuple[str, int], int]:
    """``consumer_lag`` per (topic, partition) from a librdkafka statistics document (STATISTICS.md).

    Partitions not assigned (or whose lag is not known yet, -1) are left out; ``consumer_lag``
    is the high (or last stable) offset minus the committed offset.
    """
    lag: dict[tuple[str, int], int] = {}
    for topic, data in json.loads(stats_json).get("topics", {}).items():
        for partition, fields in data.get("partitions", {}).items():
            value = int(fields.get("consumer_lag", -1))
            if int(partition) >= 0 and value >= 0 and fields.get("fetch_state", "active") != "none":
                lag[(topic, int(partition))] = value
    return lag


class KafkaBus:
    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings

    def ensure_topics(self, topics: Sequence[str], compacted: Sequence[str] = ()) -> None:
        """Create missing topics (one partition each for now); the compacted ones keep the latest per
        key, the ledger (``topics.placements``) every record (``LEDGER_CONFIG``)."""
        admin = AdminClient(_client_config(self.settings), logger=KafkaLog())
        self.reach(admin)
        try:
            self._create(admin, topics, compacted)
        except KafkaException as exc:
            raise BrokerError(f"cannot set up topics on Kafka at {self.settings.bootstrap_servers}: {exc}") from None

    def reach(self, admin: AdminClient) -> None:
        """Raise ``BrokerError`` naming the bootstrap servers when no broker answers within
        ``CONNECT_TIMEOUT_S`` (librdkafka alone would retry in silence until a request timed out)."""
        servers = self.settings.bootstrap_servers
        log.info("connecting to Kafka", bootstrap_servers=servers)
        try:
            admin.list_topics(timeout=CONNECT_TIMEOUT_S)
        except KafkaException as exc:
            error = exc.args[0]
            why = error.str() if isinstance(error, KafkaError) else str(exc)
            raise BrokerError(
                f"no Kafka broker answered at {servers} (kafka.bootstrap_servers) within {CONNECT_TIMEOUT_S:g} s:"
                f" {why}; is the broker running and reachable from here?"
            ) from None

    def _create(self, admin: AdminClient, topics: Sequence[str], compacted: Sequence[str]) -> None:
        ledger = self.settings.topics.placements
        wanted = [
            NewTopic(t, num_partitions=1, replication_factor=-1, config=LEDGER_CONFIG if t == ledger else {})
            for t in topics
        ]
        wanted += [
            NewTopic(t, num_partitions=1, replication_factor=-1, config={"cleanup.policy": "compact"})
            for t in compacted
        ]
        for topic, future in admin.create_topics(wanted, request_timeout=15.0).items():
            try:
                future.result()
                log.info("topic created", topic=topic)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        self._wait_for_leaders(admin, [*topics, *compacted], timeout_s=30.0)

    @staticmethod
    def _wait_for_leaders(admin: AdminClient, topics: Sequence[str], timeout_s: float) -> None:
        # A new topic answers NOT_LEADER_FOR_PARTITION until its partitions have a leader.
        deadline = time.monotonic() + timeout_s
        while True:
            metadata = admin.list_topics(timeout=10.0).topics
            missing = [
                t for t in topics
                if t not in metadata or metadata[t].error is not None
                or any(p.leader < 0 for p in metadata[t].partitions.values())
            ]  # fmt: skip
            if not missing:
                return
            if time.monotonic() > deadline:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"no leader yet for topics {missing}"))
            time.sleep(0.2)

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> KafkaSource:
        return KafkaSource(self.settings, topics, group_id, start)

    def publisher(self) -> KafkaPublisher:
        return KafkaPublisher(self.settings)

    def read_all(
        self, topic: str, partitions: Sequence[int] | None = None, timeout_s: float | None = None
    ) -> list[RawEvent]:
        """Every committed record of ``topic`` (of ``partitions`` only, where named) up to its high
        watermarks now, read without a consumer group.

        A partition is done when the consumer's position reaches its high watermark: the position
        moves past transaction markers too, which no record shows. ``timeout_s``: raise
        ``BrokerError`` when not done by then (None: wait as long as it takes).
        """
        consumer = Consumer(
            {
                **_client_config(self.settings),
                "group.id": "hlb-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
            }
        )
        try:
            metadata = consumer.list_topics(topic, timeout=15.0).topics[topic]
            if metadata.error is not None:
                if metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    return []
                raise KafkaException(metadata.error)
            wanted = [p for p in metadata.partitions if partitions is None or p in partitions]
            ends: dict[int, int] = {}
            for partition in wanted:
                low, high = _watermarks(consumer, TopicPartition(topic, partition), timeout_s=30.0)
                if high > low:
                    ends[partition] = high
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
            records: list[RawEvent] = []
            left = dict(ends)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while left:
                for message in consumer.consume(1000, 0.5):
                    error = message.error()
                    if error is None:
                        record = _raw(message)
                        if record.offset < ends[record.partition]:
                            records.append(record)
                    elif error.code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(error)
                for position in consumer.position([TopicPartition(topic, p) for p in left]):
                    if position.offset >= left[position.partition]:
                        del left[position.partition]
                if left and deadline is not None and time.monotonic() > deadline:
                    raise BrokerError(f"{topic}: partitions {sorted(left)} not read to their end in {timeout_s:.0f} s")
            return records
        finally:
            consumer.close()


_LEADER_SETTLING = (
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TIMED_OUT,
)


def _watermarks(consumer: Consumer, partition: TopicPartition, timeout_s: float) -> tuple[int, int]:
    """Low and high offsets of a partition, retrying while a new topic's leader settles."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(partition, timeout=10.0)
            return low, high
        except KafkaException as exc:
            error = exc.args[0]
            settling = error.retriable() or error.code() in _LEADER_SETTLING
            if not settling or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class KafkaSource:
    """A group consumer of the input topics; each assigned partition starts at ``start`` (the
    snapshot's offsets) where given, else at its earliest retained record."""

    def __init__(
        self,
        settings: KafkaSettings,
        topics: Sequence[str],
        group_id: str,
        start: Offsets | None = None,
        statistics_interval_ms: int = 1000,
    ) -> None:
        self._start = dict(start or {})
        self._lag: dict[tuple[str, int], int] = {}
        config: ClientConfig = {
            # Tunables: kafka.client_config overrides them.
            "fetch.wait.max.ms": 50,
            # Once more than queued.min.messages (100,000) are prefetched, librdkafka waits this
            # long before it fetches again. Its default, 1 s, is longer than ingest takes to apply
            # those records (about 0.4 s), so a catching-up ingest (a replay, a backlog) then sat
            # idle with an empty queue for up to 0.6 s while the graph fell behind.
            "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
            "statistics.interval.ms": statistics_interval_ms,
            **_client_config(settings),
            # What hlb's correctness depends on (config.FIXED_CLIENT_KEYS refuses overrides).
            "group.id": group_id,
            "enable.auto.offset.store": False,
            "enable.auto.commit": True,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
        }
        if settings.group_instance_id:
            config["group.instance.id"] = settings.group_instance_id
        self.config = dict(config)  # what librdkafka was given (secrets included: do not log it)
        self._kafka_log = KafkaLog()
        self._consumer = Consumer({**config, "stats_cb": self._on_stats}, logger=self._kafka_log)
        self._join(list(topics))

    def _join(self, topics: list[str]) -> None:
        """Take part in the group's assignment of ``topics`` (a subclass may assign instead)."""
        self._consumer.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for partition in partitions:
            partition.offset = self._start.get((partition.topic, partition.partition), OFFSET_BEGINNING)
        consumer.incremental_assign(partitions)
        log.info("partitions assigned", partitions=[f"{p.topic}[{p.partition}]@{p.offset}" for p in partitions])

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_unassign(partitions)
        log.info("partitions revoked", partitions=[f"{p.topic}[{p.partition}]" for p in partitions])

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member may own them already: nothing is committed for them.
        consumer.incremental_unassign(partitions)
        log.warning("partitions lost", partitions=[f"{p.topic}[{p.partition}]" for p in partitions])

    def _on_stats(self, stats_json: str) -> None:
        try:
            self._lag = parse_lag(stats_json)
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("unreadable consumer statistics", error=str(exc))

    def lag(self) -> dict[tuple[str, int], int]:
        return dict(self._lag)

    def next_batch(self, max_events: int, timeout_s: float) -> list[RawEvent]:
        # consume(n, t) waits until it has n records or t has passed: asked for a big batch with a
        # timeout it would hold records back. So: take what is queued; when nothing is, wait for
        # the first record only, then take what is queued behind it.
        messages = self._consumer.consume(max_events, 0)
        if not messages and timeout_s > 0:
            messages = self._consumer.consume(1, timeout_s)
            if messages and max_events > 1:
                messages += self._consumer.consume(max_events - 1, 0)
        if messages:
            self._kafka_log.healthy()
        errors = list(map(_M.error, messages))
        if errors.count(None) == len(messages):
            return _raws(messages)
        batch = _raws([m for m, e in zip(messages, errors, strict=True) if e is None])
        for message, error in zip(messages, errors, strict=True):
            if error is None:
                continue
            if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                log.debug("topic not there yet", topic=message.topic())
            elif error.fatal():
                raise KafkaException(error)
            else:
                log.warning("consumer error", error=str(error))
        return batch

    def commit(self, batch: Sequence[RawEvent]) -> None:
        # A partition's records come in offset order, so its last record in the batch is its newest.
        ends = {(r.topic, r.partition): r.offset + 1 for r in batch}
        self._consumer.store_offsets(offsets=[TopicPartition(t, p, o) for (t, p), o in ends.items()])
        self._start.update(ends)  # a partition revoked and assigned again resumes after what was applied

    def close(self) -> None:
        self._consumer.close()  # commits the stored offsets and leaves the group


class KafkaPublisher:
    """The producer of every record the daemon publishes. ``delivery_failures``: records the
    broker did not take (or that timed out), by topic; each kind is logged, folded (``FoldedLog``)."""

    def __init__(self, settings: KafkaSettings) -> None:
        self._producer = Producer(
            {"linger.ms": 5, **_client_config(settings), "enable.idempotence": True},
            logger=KafkaLog(),
        )
        self.delivery_failures: Counter[str] = Counter()
        self._log_failure = FoldedLog("delivery failed")

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        produce(self._producer, topic, key, value, headers, self._delivered)

    def _delivered(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            topic = message.topic() or ""
            self.delivery_failures[topic] += 1
            self._log_failure(f"{topic}:{error.code()}", topic=topic, error=str(error))

    def flush(self, timeout_s: float) -> int:
        remaining: int = self._producer.flush(timeout_s)
        return remaining


DeliveryCallback = Callable[[KafkaError | None, Message], None]


def produce(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, bytes]] = (),
    on_delivery: DeliveryCallback | None = None,
) -> None:
    """Queue one record, waiting while librdkafka's local queue is full; failures are logged on
    delivery (``on_delivery``, else each one). Raises ``KafkaException`` for a record librdkafka
    refuses at once (``MSG_SIZE_TOO_LARGE``: bigger than ``message.max.bytes``)."""
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=list(headers), on_delivery=on_delivery or _delivered)
            break
        except BufferError:  # local queue full: let librdkafka send some, then retry
            producer.poll(0.1)
    producer.poll(0)


def _delivered(error: KafkaError | None, message: Message) -> None:
    if error is not None:
        log.error("delivery failed", topic=message.topic(), error=str(error))
