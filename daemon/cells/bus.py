"""Kafka's part in several instances sharing the cells (docs/design.md §9); ``hlb.daemon.cells.host`` runs them.

Kafka does all the coordinating; hlb adds no protocol of its own:

- **Who owns a partition** is the consumer group's answer: every instance is a member of
  ``kafka.group_id`` subscribed to the cells topic (``CellGroup``), with cooperative-sticky
  assignment and static membership (``group.instance.id``), so a restart within
  ``session.timeout.ms`` keeps its partitions and a dead member's move to the others. Owning
  partition p of the cells topic means owning partition p of every input topic, and so the cell
  whose records land there.
- **Where a cell lands**: the key of every record is its cell, and librdkafka's default
  partitioner (``consistent_random``: CRC-32 of the key) puts it on ``shard_of(cell)``; hlb's own
  producers use that partitioner, and so do kcat and the confluent-kafka clients.
- **Who to ask**: an owner announces a partition it serves (``Claim``, JSON) on the compacted
  cells topic, key ``shard-<p>``; every instance reads the topic (``ClaimBoard``) and forwards a
  request for a cell it does not own to the announced address.
- **No two owners write**: decisions are published in Kafka transactions, one transactional id
  per partition (``TransactionalPublisher``). The new owner's ``init_transactions`` fences the old
  one and aborts what it left open, and the ledger is read back ``read_committed``, so a decision
  is in the ledger exactly when its transaction committed, and an answer is given only after that.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from hlb.daemon.bus.kafka import (
    LEDGER_CONFIG,
    ClientConfig,
    KafkaBus,
    KafkaPublisher,
    KafkaSource,
    _client_config,
    produce,
)
from hlb.daemon.bus.kafkalog import KafkaLog
from hlb.daemon.bus.lag import KafkaLagProbe
from hlb.daemon.bus.seam import Offsets, RawEvent
from hlb.daemon.config import KafkaSettings
from hlb.daemon.errors import BrokerError, ConfigError

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Claim:
    """An owner's announcement about one partition (shard): who serves it and where."""

    shard: int
    instance: str  # kafka.group_instance_id of the owner
    address: str  # host:port of its gRPC server
    serving: bool  # False: rebuilding (snapshot, ledger, replay) or released
    cell: str = ""  # the cell the partition carries; empty while none is known
    since_ms: int = 0

    @property
    def key(self) -> bytes:
        return f"shard-{self.shard}".encode()

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes) -> Claim:
        data = json.loads(value)
        return cls(
            shard=int(data["shard"]),
            instance=str(data["instance"]),
            address=str(data["address"]),
            serving=bool(data["serving"]),
            cell=str(data.get("cell", "")),
            since_ms=int(data.get("since_ms", 0)),
        )


def ensure_cell_topics(
    settings: KafkaSettings, topics: Sequence[str], compacted: Sequence[str], partitions: int
) -> None:
    """Create the topics with ``partitions`` partitions where missing; refuse existing ones with
    another count (cells would land on other partitions than the instances expect)."""
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient(_client_config(settings), logger=KafkaLog())
    ledger = settings.topics.placements  # read back at every start: it keeps every record
    wanted = [
        NewTopic(t, num_partitions=partitions, replication_factor=-1, config=LEDGER_CONFIG if t == ledger else {})
        for t in topics
    ]
    wanted += [
        NewTopic(t, num_partitions=partitions, replication_factor=-1, config={"cleanup.policy": "compact"})
        for t in compacted
    ]
    try:
        for topic, future in admin.create_topics(wanted, request_timeout=15.0).items():
            try:
                future.result()
                log.info("topic created", topic=topic, partitions=partitions)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        KafkaBus._wait_for_leaders(admin, [*topics, *compacted], timeout_s=30.0)
        metadata = admin.list_topics(timeout=10.0).topics
    except KafkaException as exc:
        raise BrokerError(f"cannot set up topics on Kafka at {settings.bootstrap_servers}: {exc}") from None
    wrong = {t: len(metadata[t].partitions) for t in [*topics, *compacted] if len(metadata[t].partitions) != partitions}
    if wrong:
        found = ", ".join(f"{t} has {n}" for t, n in sorted(wrong.items()))
        raise ConfigError(f"cells.partitions is {partitions} but {found}: every input topic needs that many partitions")


class PartitionSource(KafkaSource):
    """The input topics' partition ``shard`` only, assigned by hand (the group decides ownership
    through the cells topic, not through these topics); reads ``read_committed``."""

    def __init__(
        self, settings: KafkaSettings, topics: Sequence[str], shard: int, group_id: str, start: Offsets | None = None
    ) -> None:
        self._shard = shard
        # A member of no group: the static id belongs to the instance's CellGroup.
        super().__init__(settings.model_copy(update={"group_instance_id": None}), topics, group_id, start)

    def _join(self, topics: list[str]) -> None:
        self._assigned = [TopicPartition(t, self._shard) for t in topics]
        start = [TopicPartition(t, self._shard, self._start.get((t, self._shard), OFFSET_BEGINNING)) for t in topics]
        self._consumer.assign(start)
        log.info("shard inputs assigned", partitions=[f"{p.topic}[{p.partition}]@{p.offset}" for p in start])

    def positions(self) -> dict[tuple[str, int], int]:
        """The next offset the consumer hands out per partition: past transaction markers too,
        which no record shows (the tasks topic carries API submissions in transactions)."""
        return {(p.topic, p.partition): p.offset for p in self._consumer.position(self._assigned) if p.offset >= 0}


class TransactionalPublisher:
    """A producer whose records count only once ``commit`` has committed their transaction.

    One transactional id per partition: ``init_transactions`` by a new owner fences the old one.
    A transaction opens at the first record after a commit. Records of a transaction that had to
    be aborted are produced again in the next one, so nothing handed to ``publish`` is lost while
    the producer is not fenced. ``FencedError`` means another instance owns the partition now.
    """

    def __init__(self, settings: KafkaSettings, transactional_id: str, timeout_s: float = 30.0) -> None:
        config: ClientConfig = {
            "linger.ms": 5,
            **_client_config(settings),
            "enable.idempotence": True,
            "transactional.id": transactional_id,
        }
        self._producer = Producer(config, logger=KafkaLog())
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._open: list[tuple[str, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]] = []
        try:
            self._producer.init_transactions(timeout_s)
        except KafkaException as exc:
            raise BrokerError(f"transactions for {transactional_id}: {exc}") from None

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        with self._lock:
            record = (topic, key, value, tuple(headers))
            if not self._open:
                self._producer.begin_transaction()
            self._open.append(record)
            self._produce(record)

    def _produce(self, record: tuple[str, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]) -> None:
        topic, key, value, headers = record
        produce(self._producer, topic, key, value, headers)

    def commit(self) -> None:
        """Commit the open transaction (a no-op when none is open). Raises ``FencedError`` when
        another instance owns the transactional id now."""
        with self._lock:
            while self._open:
                try:
                    self._producer.commit_transaction(self._timeout_s)
                except KafkaException as exc:
                    error = exc.args[0]
                    if error.fatal() or error.code() == KafkaError._FENCED:
                        raise FencedError(str(error)) from None
                    if error.txn_requires_abort():
                        log.warning("transaction aborted; its records go into the next", error=str(error))
                        self._producer.abort_transaction(self._timeout_s)
                        self._producer.begin_transaction()
                        for record in self._open:
                            self._produce(record)
                        continue
                    if error.retriable():
                        continue
                    raise
                self._open = []

    def flush(self, timeout_s: float) -> int:
        try:
            self.commit()
        except (FencedError, KafkaException) as exc:
            log.error("decisions not committed", error=str(exc), records=len(self._open))
            return len(self._open)
        return 0

    def close(self) -> None:
        self._producer.flush(1.0)


class FencedError(Exception):
    """Another instance took over the partition: this one must stop deciding for it."""


class PartitionBus:
    """The bus seam of one shard: inputs and the ledger of partition ``shard`` only; topics are
    set up by the instance (``ensure_cell_topics``)."""

    def __init__(self, settings: KafkaSettings, shard: int) -> None:
        self.settings = settings
        self.shard = shard

    def ensure_topics(self, topics: Sequence[str], compacted: Sequence[str] = ()) -> None:
        return None

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> PartitionSource:
        return PartitionSource(self.settings, topics, self.shard, f"{group_id}.shards", start)

    def lag_probe(self, topics: Sequence[str], group_id: str) -> KafkaLagProbe:
        """The lag of :meth:`source`'s reads: its group, this partition."""
        return KafkaLagProbe(self.settings, topics, f"{group_id}.shards", [self.shard])

    def publisher(self) -> KafkaPublisher:
        return KafkaPublisher(self.settings)

    def read_all(self, topic: str) -> list[RawEvent]:
        return KafkaBus(self.settings).read_all(topic, [self.shard], timeout_s=60.0)


# What the group tells the instance: the partitions of the cells topic it was given or lost.
OnShards = Callable[[list[int]], None]


class CellGroup(threading.Thread):
    """This instance's membership of the group that shares the cells: a consumer of the cells
    topic polled on its own thread, so that the rebalance callbacks run.

    ``on_assigned`` is called with the partitions given to this instance. ``on_revoked`` with the
    ones taken away, and it returns only when they are handed over (their snapshot written and
    decisions committed), so the next owner starts from everything this one did.
    """

    def __init__(self, settings: KafkaSettings, topic: str, on_assigned: OnShards, on_revoked: OnShards) -> None:
        super().__init__(name="hlb-cell-group", daemon=True)
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None
        config: ClientConfig = {
            "session.timeout.ms": 10_000,
            **_client_config(settings),
            "group.id": settings.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "latest",  # the members read nothing from it: claims are ClaimBoard's
            "partition.assignment.strategy": "cooperative-sticky",
        }
        if settings.group_instance_id:
            config["group.instance.id"] = settings.group_instance_id
        self._consumer = Consumer(config, logger=KafkaLog())
        self._consumer.subscribe([topic], on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if partitions:
            self._on_assigned(sorted(p.partition for p in partitions))

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if partitions:
            self._on_revoked(sorted(p.partition for p in partitions))
        consumer.incremental_unassign(partitions)

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member may own them already; fencing keeps this one from writing for them.
        log.warning("cell partitions lost", shards=sorted(p.partition for p in partitions))
        if partitions:
            self._on_revoked(sorted(p.partition for p in partitions))
        consumer.incremental_unassign(partitions)

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                for message in self._consumer.consume(100, 0.2):
                    error = message.error()
                    if error is not None and error.fatal():
                        raise KafkaException(error)
        except BaseException as exc:
            self.failure = exc
            log.exception("cell group member failed")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Leave the group (the revoke callback hands every partition over first)."""
        self._stop_event.set()
        if self.ident is not None:
            self.join(timeout_s)
        self._consumer.close()


class ClaimBoard(threading.Thread):
    """The newest ``Claim`` of every partition, read from the cells topic on its own thread."""

    def __init__(self, settings: KafkaSettings, topic: str, partitions: int) -> None:
        super().__init__(name="hlb-claims", daemon=True)
        self._claims: dict[int, Claim] = {}
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._consumer = Consumer(
            {
                **_client_config(settings),
                "group.id": f"{settings.group_id}.claims",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 50,
            },
            logger=KafkaLog(),
        )
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])

    def claims(self) -> dict[int, Claim]:
        with self._lock:
            return dict(self._claims)

    def get(self, shard: int) -> Claim | None:
        with self._lock:
            return self._claims.get(shard)

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                messages = self._consumer.consume(100, 0.2)
            except KafkaException as exc:
                log.warning("cells topic unreadable", error=str(exc))
                time.sleep(1.0)
                continue
            updates: list[Claim] = []
            for message in messages:
                value = message.value()
                if message.error() is not None or not value:
                    continue
                try:
                    updates.append(Claim.decode(value if isinstance(value, bytes) else value.encode()))
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("unreadable claim skipped", offset=message.offset(), error=str(exc))
            if updates:
                with self._lock:
                    for claim in updates:
                        self._claims[claim.shard] = claim

    def stop(self) -> None:
        self._stop_event.set()
        if self.ident is not None:
            self.join(5.0)
        self._consumer.close()
