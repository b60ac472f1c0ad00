"""One shard of an instance that shares the cells: a daemon deciding for one partition of the inputs
(``Shard.run_shard``), started and stopped by ``hlb.daemon.cells.host``, which serves the gRPC API.

Like ``Daemon.run`` without the server and the journal: the transactional producer is set up
first (fencing the partition's previous owner and aborting what it left open), then the ledger is
read back ``read_committed``, the newest snapshot restored and the inputs replayed. Decisions are
committed in a transaction before an RPC that made them answers, and those made by ingest every
``cells.commit_interval_s``. The partition carries one cell: every record's key names it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.bus.seam import EventBus, EventSource, Offsets, RawEvent
from hlb.daemon.cells.bus import PartitionBus, TransactionalPublisher
from hlb.daemon.config import Settings
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.ingest.pipeline import Ingestor, IngestThread
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.runtime.metrics import watch_lag
from hlb.daemon.runtime.policy import stop_policy
from hlb.daemon.runtime.publish import CountingPublisher
from hlb.daemon.runtime.restore import read_watermarks, replay_targets
from hlb.daemon.runtime.sdnotify import SystemdNotifier
from hlb.daemon.serve.api import SchedulerService

log = structlog.get_logger(__name__)


class Shard(Daemon):
    """The daemon of partition ``shard``; systemd hears from the instance, not from its shards."""

    def __init__(self, settings: Settings, bus: EventBus, shard: int) -> None:
        super().__init__(settings, bus, notifier=SystemdNotifier(environ={}))
        self.shard = shard
        # Decisions are committed in Kafka transactions instead of the journal (``run_shard``).
        self.journal_enabled = False
        self.transactions: TransactionalPublisher | None = None
        self.service: SchedulerService | None = None  # what the instance's router asks (``run_shard``)

    def dump_labels(self) -> dict[str, Any]:
        """The shard's dump is in its own state directory (``<state_dir>/shards/<partition>``)."""
        return {"cell": self.scheduler.cell, "shard": self.shard}

    def models_source(self, topics: list[str], group: str) -> EventSource:
        """The models topic whole (one partition, every cell's), not this shard's partition."""
        return KafkaBus(self.settings.kafka).source(topics, group)

    async def durable(self) -> None:
        """Commit the open transaction: an answer waits for its decisions in the ledger topic."""
        if self.transactions is not None:
            await asyncio.to_thread(self.transactions.commit)

    def capture_replay_targets(self, inputs: Sequence[str], start: Offsets | None) -> None:
        """As a daemon's, for this shard's partition of the inputs only."""
        marks = read_watermarks(self.bus, self.settings, inputs)
        if marks is not None:
            mine = {key: mark for key, mark in marks.items() if key[1] == self.shard}
            self.replay_targets = replay_targets(mine, start, self.bus, self.settings.kafka.group_id)

    async def run_shard(self, stop: asyncio.Event, announce: Callable[[bool], None]) -> None:
        """Decide for the partition until ``stop`` is set; ``announce(True)`` once caught up,
        ``announce(False)`` before that. Stops early, raising, when the producer is fenced (a new
        owner took the partition) or ingest fails."""
        kafka = self.settings.kafka
        topics = kafka.topics
        transactions = await asyncio.to_thread(TransactionalPublisher, kafka, f"{kafka.group_id}.shard-{self.shard}")
        self.transactions = transactions
        self.publisher = transactions
        restored = await asyncio.to_thread(self.restore_ledger)
        start = await asyncio.to_thread(self.restore_snapshot)
        if not self.scheduler.cell:
            self.scheduler.cell = next((p.cell for p in self.ledger.since(0) if p.cell), "")
        log.info("shard restored", shard=self.shard, cell=self.scheduler.cell, placements=restored)
        self._follow_ledger()  # and the feature log's, with learning.log_features
        inputs = [topics.telemetry, topics.tasks]
        await asyncio.to_thread(self.capture_replay_targets, inputs, start)
        ingest = self._shard_ingest(inputs, start)
        self._observe(inputs)
        self.service = self._make_service()
        if self.snapshots is not None:
            self.on_shutdown_snapshot = self.write_snapshot
            self._spawn(self._snapshot_every(self.settings.snapshot.interval_s))
        committing = asyncio.ensure_future(self._commit_every(transactions, self.settings.cells.commit_interval_s))
        failure: BaseException | None = None
        try:
            await asyncio.to_thread(self._start_policy)
            ingest.start()
            announce(False)
            if await self._replay_until_caught_up(stop, ingest):
                # Leases come due only once the replay has rebuilt every placement and start.
                self._spawn(self._expire_leases_every(self.settings.leases.check_interval_s))
                self.serving = True
                announce(True)
                log.info("shard serving", shard=self.shard, cell=self.scheduler.cell)
                stopped = asyncio.ensure_future(stop.wait())
                while not stopped.done() and not committing.done() and ingest.is_alive():
                    await asyncio.wait([stopped, committing], timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
        finally:
            self.serving = False
            await asyncio.to_thread(self.stop_lifecycle)
            stop_policy(self.scheduler.policy)
            if committing.done() and committing.exception() is not None:
                failure = committing.exception()
            committing.cancel()
            await self._hand_over(ingest, transactions, fenced=failure is not None)
        if failure is not None:
            raise failure
        if ingest.failure is not None:
            raise RuntimeError("ingest failed") from ingest.failure

    def _observe(self, inputs: Sequence[str]) -> None:
        """Let the instance's ``/metrics`` read this shard (``hlb.daemon.cells.metrics``), with the
        consumer lag of its partition of ``inputs``."""
        self.metrics.observe(self.metrics_sample)
        if self.settings.metrics.listen and isinstance(self.bus, PartitionBus):
            probe = self.bus.lag_probe(inputs, self.settings.kafka.group_id)
            self._spawn(watch_lag(probe, self.settings.metrics.lag_interval_s, self._record_lag))

    def _shard_ingest(self, inputs: Sequence[str], start: Offsets | None) -> IngestThread:
        kafka = self.settings.kafka
        source = self.bus.source(inputs, kafka.group_id, start)
        dead_letters = CountingPublisher(self.raw_publisher, kafka.topics.dlq, self.metrics)
        ingestor = Ingestor(
            source,
            dead_letters,
            self.scheduler,
            self.lock,
            kafka.topics,
            kafka.max_event_bytes,
            limits=self.settings.limits,
            dead_letter_max_bytes=kafka.dead_letter_max_bytes,
            tenants=self.access.task_event_refusal,
            backlog=self.tenant_backlog,
        )
        ingestor.admit = self._admit
        ingestor.after_pass = self.decisions.take_back
        ingestor.pipelines[kafka.topics.tasks].insert(1, self._same_cell)
        self._ingestor = ingestor
        self.ingest = IngestThread(ingestor, kafka.batch_size, kafka.poll_timeout_s)
        return self.ingest

    async def _commit_every(self, transactions: TransactionalPublisher, interval_s: float) -> None:
        """Commit what ingest decided; returns (raising) only when the producer was fenced."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(transactions.commit)

    async def _hand_over(self, ingest: IngestThread, transactions: TransactionalPublisher, *, fenced: bool) -> None:
        """Stop so that the next owner starts from everything this shard did: ingest stops, the
        snapshot is written, the open transaction committed (unless fenced: it is not ours now)."""
        if ingest.ident is not None:
            await asyncio.to_thread(ingest.stop)
        if self.features is not None:  # what ingest decided last is queued: published first
            await asyncio.to_thread(self.features.stop, 10.0)
        try:
            await asyncio.to_thread(self.on_shutdown_snapshot)
        except Exception:
            log.exception("shard snapshot failed", shard=self.shard)
        if not fenced:
            undelivered = await asyncio.to_thread(transactions.flush, 10.0)
            if undelivered:
                log.error("shard handed over with decisions not committed", shard=self.shard, records=undelivered)
        await self._cancel_background()
        await asyncio.to_thread(self.raw_publisher.flush, 5.0)
        await asyncio.to_thread(transactions.close)
        log.info("shard stopped", shard=self.shard, fenced=fenced)

    def _admit(self, record: RawEvent) -> str | None:
        """A shard's records must carry its one cell as their key (the first one seen adopts it)."""
        key = record.key.decode("utf-8", "replace") if record.key else ""
        if not key:
            return f"partition {record.partition}: no key; with several instances the key must be the cell"
        cell = self.scheduler.cell
        if not cell:
            self.scheduler.cell = key
            log.info("shard adopts its cell", shard=self.shard, cell=key)
            return None
        if key != cell:
            return (
                f"partition {record.partition} carries cell {cell!r}, and cell {key!r} lands there too: "
                "give the topics more partitions (cells.partitions) or the cell another name"
            )
        return None

    def _same_cell(self, _: RawEvent, event: Any) -> Any:
        """A task event of a shard names its cell or none (the key already named it)."""
        if event.cell and event.cell != self.scheduler.cell:
            raise InvalidEventError(
                f"event for cell {event.cell!r} under key {self.scheduler.cell!r}: the key must be the cell",
                "wrong_cell",
            )
        return event
