"""``hlb serve``: the daemon, wired from its parts, and its life as a service.

Start-up: check the gRPC listener and its TLS files, restore the placement ledger from its
topic, then the decisions of the journal (``hlb.daemon.record.journal``) that the topic lacks (published
again), then the newest snapshot; note the input topics' end offsets (high watermarks) now; start
ingest on its own thread, the gRPC server and the metrics endpoint. Health stays NOT_SERVING, and
the deciding RPCs answer UNAVAILABLE, until ingest has replayed the inputs up to those end
offsets: only then does the graph hold everything decided and submitted before the start. Then
SERVING (health) and READY=1 (systemd).

With the Kafka bus, every decision is in the journal before the RPC that made it answers
(``Daemon.durable``): in the file, fsynced off the request path (``journal.sync: write``), or on
disk (``fsync``). Either way a SIGKILL cannot make the restarted daemon forget an
answer; with ``fsync`` neither can the machine going down.

SIGTERM or SIGINT, in this order: STOPPING=1 and health NOT_SERVING; the gRPC server refuses new
RPCs and gives in-flight ones ``grpc.grace_s``; ingest stops, which stores and commits the
offsets of everything applied; ``Daemon.on_shutdown_snapshot`` runs (the snapshot seam); the
producer flushes what is still queued; the metrics endpoint closes last. Exit code 0.

SIGHUP re-reads the config file with the one loader. Keys with a reloader (``Daemon.reloaders``:
log level and format, the scheduler section, the request-rate limit) take effect at once; every
other changed key is logged by name as needing a restart and keeps its running value. A config
that no longer loads is logged and the running one kept.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import Counter
from pydantic import BaseModel

from hlb.daemon.bus.codec import decode
from hlb.daemon.bus.lag import (
    EndOffsetProbe,
    KafkaEndOffsets,
    KafkaLagProbe,
    Lag,
    LagProbe,
    MemoryEndOffsets,
    MemoryLagProbe,
)
from hlb.daemon.bus.seam import EventBus, MemoryBus, Publisher, RawEvent
from hlb.daemon.config import EX_CONFIG, Settings, Topics, default_config_path, load_settings
from hlb.daemon.decide.gnn.policy import GnnPolicy
from hlb.daemon.decide.policy import ObjectiveWeights, Policy, make_policy
from hlb.daemon.decide.scheduler import Clock, Scheduler
from hlb.daemon.errors import BrokerError, ConfigError, EventError, InvalidEventError
from hlb.daemon.ingest.pipeline import Ingestor, IngestStats, IngestThread
from hlb.daemon.logs import configure_logging
from hlb.daemon.record import snapshot
from hlb.daemon.record.journal import AnswerGate, JournaledPublisher, JournalFile
from hlb.daemon.record.statedump import canonical_state, write_dump
from hlb.daemon.runtime.metrics import (
    DaemonMetrics,
    MetricsServer,
    RpcMetricsInterceptor,
    StateSample,
    start_metrics_server,
)
from hlb.daemon.runtime.sdnotify import SystemdNotifier, WatchdogPinger
from hlb.daemon.serve.api import GrpcServer, SchedulerService, cluster_state
from hlb.daemon.serve.ratelimit import RateLimitInterceptor, TokenBucket, default_burst
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev

if TYPE_CHECKING:
    from hlb.daemon.cells.bus import TransactionalPublisher

log = structlog.get_logger(__name__)

# Applies the reloadable part of new settings; raises to refuse them (the old values stay).
Reloader = Callable[[Settings], None]

JOURNAL_SYNC_S = 0.05  # decisions made by ingest reach the disk this often (the API's at once)
JOURNAL_ACK_S = 1.0  # how often acknowledged records are dropped from the journal
REPLAY_CHECK_S = 0.05


def make_bus(settings: Settings) -> EventBus:
    if settings.bus == "memory":
        return MemoryBus()
    from hlb.daemon.bus.kafka import KafkaBus  # librdkafka loads only when Kafka is used

    return KafkaBus(settings.kafka)


@dataclass(frozen=True)
class ReloadResult:
    """What a reload did, by dotted key (``log.level``). Values are never listed: they may be secrets."""

    applied: tuple[str, ...] = ()
    needs_restart: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    error: str | None = None  # the new config did not load; nothing changed


class Daemon:
    """One hlb instance: graph, scheduler, ingest thread and gRPC server around one lock.

    Seams for the parts that plug in here:

    - ``on_shutdown_snapshot``: called once on shutdown, after ingest has stopped and before
      the producer is flushed; a no-op until snapshots exist. An exception is logged and makes
      the exit code 1.
    - ``reloaders``: dotted-key prefix (``"scheduler."``) or exact key -> ``Reloader``. A model
      loader registers ``"model."`` here; a changed key without a reloader needs a restart.
    """

    def __init__(
        self,
        settings: Settings,
        bus: EventBus,
        clock: Clock = time.time,
        *,
        config_path: Path | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        shard: int | None = None,
    ) -> None:
        self.settings = settings
        # One partition of the inputs, for an instance that shares the cells (``run_shard``).
        self.shard = shard
        self.bus = bus
        self.clock = clock
        self.config_path = config_path
        self.lock = threading.RLock()
        self.ledger = PlacementLedger()
        self.metrics = DaemonMetrics()
        policy = self._make_policy(settings)
        self.scheduler = Scheduler(
            InfraGraph(settings.scheduler.max_tasks_per_device),
            policy,
            self.ledger,
            settings.cell,
            clock,
            keep_ended_s=settings.scheduler.keep_ended_s,
            remember_ended=settings.scheduler.remember_ended,
        )
        self.raw_publisher = bus.publisher()
        self.decisions = DecisionPublisher(
            self.raw_publisher, settings.kafka.topics, self.scheduler, clock, self.metrics.placements
        )
        # The journal: on by default with Kafka (a memory bus ends with the process anyway).
        self.journal_enabled = settings.bus == "kafka" and shard is None
        # A shard's decisions are committed in Kafka transactions instead (``run_shard``).
        self.transactions: TransactionalPublisher | None = None
        self.service: SchedulerService | None = None
        self.journal: JournalFile | None = None
        self._answer_gate: AnswerGate | None = None
        self._journaled: JournaledPublisher | None = None
        # Input partitions -> the offset replay must reach before the daemon serves (see run()).
        self.replay_targets: dict[tuple[str, int], int] = {}
        self.ready = asyncio.Event()
        self.port = 0
        self.metrics_port = 0
        # systemd hears from the instance, not from each of its shards.
        self.notifier = SystemdNotifier() if shard is None else SystemdNotifier(environ={})
        self.serving = False
        self.on_shutdown_snapshot: Callable[[], None] = lambda: None
        self.reloaders: dict[str, Reloader] = {
            "log.": self._reload_logging,
            "scheduler.": self._reload_scheduler,
            "model.": self._reload_model,
            "grpc.max_requests_per_s": self._reload_rate_limit,
            "grpc.request_burst": self._reload_rate_limit,
        }
        # Keys under a reloader's section that it cannot apply: the graph is built with them.
        self.restart_only = {"scheduler.max_tasks_per_device"}
        self.rate_limit = RateLimitInterceptor(_bucket(settings, monotonic), self.metrics.count_rate_limited)
        self._monotonic = monotonic
        self._ingestor: Ingestor | None = None
        self.snapshots: snapshot.SnapshotStore | None = (
            snapshot.FileSnapshotStore(settings.state_dir / "snapshots", settings.snapshot.keep)
            if settings.snapshot.enabled and settings.bus == "kafka"  # a memory bus ends with the process
            else None
        )
        self._lag: Lag = {}
        self._reload_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()

    # -- the seams the publisher and ledger are observed through ----------------------------

    @property
    def publisher(self) -> Publisher:
        """Where the daemon's decisions go: the bus's publisher, journaled once run() opens the
        journal, or a shard's transactions (``run_shard``)."""
        return self.decisions.publisher

    @publisher.setter
    def publisher(self, publisher: Publisher) -> None:
        self.decisions.publisher = publisher

    def open_journal(self) -> int:
        """Open the journal, restore its decisions the ledger lacks and publish them again; returns
        how many were restored. Runs after ``restore_ledger`` and before anything is replayed."""
        journal = JournalFile.open(self.settings.state_dir)
        self.journal = journal
        self._answer_gate = AnswerGate(
            journal, self.settings.journal.sync, on_failure=self.metrics.journal_sync_failures.inc
        )
        self._journaled = JournaledPublisher(self.raw_publisher, journal)
        self.publisher = self._journaled
        topics = self.settings.kafka.topics
        restored = 0
        resubmitted = 0
        with self.lock:
            for record in journal.recovered:
                if record.topic == topics.placements:
                    try:
                        placement = decode(record.value, ev.Placement, self.settings.kafka.max_event_bytes)
                    except EventError as exc:
                        log.warning("unreadable journal record skipped", error=str(exc))
                        continue
                    known = self.ledger.get(placement.task_id)
                    if known is not None:
                        if list(known.device_ids) != list(placement.device_ids):
                            log.error(
                                "journal and ledger topic disagree; the topic's decision stands",
                                task_id=placement.task_id,
                            )
                        continue
                    if placement.sequence <= self.ledger.last_sequence:
                        log.error(
                            "journal decision numbered before the ledger topic's last; skipped",
                            task_id=placement.task_id,
                            sequence=placement.sequence,
                        )
                        continue
                    self.ledger.restore([placement])
                    self.raw_publisher.publish(record.topic, record.key, record.value)
                    restored += 1
                elif record.topic == topics.tasks:  # a submission through the API; a repeat is a no-op
                    self.raw_publisher.publish(record.topic, record.key, record.value)
                    resubmitted += 1
        log.info(
            "journal recovered",
            records=len(journal.recovered),
            placements_restored=restored,
            submissions_republished=resubmitted,
            last_sequence=self.ledger.last_sequence,
        )
        return restored

    async def durable(self) -> None:
        """Wait until every decision made so far is in the journal, on disk or in the file as
        ``journal.sync`` says (group commit)."""
        if self.transactions is not None:
            await asyncio.to_thread(self.transactions.commit)
            return
        if self._answer_gate is not None:
            await self._answer_gate()

    def _end_offsets(self, topics: Sequence[str]) -> EndOffsetProbe | None:
        if isinstance(self.bus, MemoryBus):
            return MemoryEndOffsets(self.bus, topics)
        if self.settings.bus == "kafka":
            return KafkaEndOffsets(self.settings.kafka, topics)
        return None

    def capture_replay_targets(self, inputs: Sequence[str], start: dict[tuple[str, int], int] | None) -> None:
        """Note, per input partition, the end offset replay must reach: its high watermark now,
        unless the consumer begins at or past it (a snapshot's offsets, or a memory bus group's)."""
        probe = self._end_offsets(inputs)
        if probe is None:
            return
        try:
            marks = probe.read()
        finally:
            probe.close()
        if self.shard is not None:
            marks = {key: mark for key, mark in marks.items() if key[1] == self.shard}
        targets = {}
        for (topic, partition), (low, high) in marks.items():
            if start is not None:
                begin = start.get((topic, partition), low)
            elif isinstance(self.bus, MemoryBus):
                begin = self.bus.committed(self.settings.kafka.group_id, topic)
            else:
                begin = low
            if high > max(begin, low):
                targets[(topic, partition)] = high
        self.replay_targets = targets
        log.info("replay targets", partitions={f"{t}[{p}]": o for (t, p), o in targets.items()})

    def replay_left(self) -> int:
        """Records still to replay before the start's end offsets are reached (0: caught up)."""
        if not self.replay_targets:
            return 0
        if self._ingestor is None:
            return sum(self.replay_targets.values())
        with self.lock:
            positions = dict(self._ingestor.positions)
        left = 0
        for partition, target in self.replay_targets.items():
            left += max(0, target - positions.get(partition, 0))
        if not left:
            self.replay_targets = {}
        return left

    def refusal(self) -> str | None:
        """Why the deciding RPCs are refused now (UNAVAILABLE), or None when they are served."""
        if self.serving:
            return None
        left = self.replay_left() if self.replay_targets else 0
        if left:
            return f"replaying the inputs after a start: {left} records left before decisions are served"
        return "the daemon is not serving (starting or stopping)"

    def restore_ledger(self) -> int:
        """Load earlier decisions so that a replayed submission is not placed twice."""
        placements = []
        for record in self.bus.read_all(self.settings.kafka.topics.placements):
            try:
                placements.append(decode(record.value, ev.Placement, self.settings.kafka.max_event_bytes))
            except EventError as exc:
                log.warning("unreadable ledger record skipped", offset=record.offset, error=str(exc))
        with self.lock:
            return self.ledger.restore(placements)

    def dump_state(self) -> Path:
        """Write the canonical state dump (``hlb.daemon.record.statedump``) to the state directory."""
        with self.lock:
            state = canonical_state(self.scheduler)
            if self._ingestor is not None:
                stats = self._ingestor.stats
                state["ingest"] = {"applied": stats.applied, "rejected": dict(stats.rejected)}
        path = write_dump(state, self.settings.state_dir)
        log.info("state dumped", path=str(path))
        return path

    def restore_snapshot(self) -> dict[tuple[str, int], int] | None:
        """Install the newest valid snapshot; returns the input offsets it covers (None: replay all)."""
        if self.snapshots is None:
            return None
        found = snapshot.restore_newest(self.snapshots)
        if found is None:
            log.info("no snapshot to restore: replaying the inputs from their earliest records")
            return None
        name, state = found
        inputs = {self.settings.kafka.topics.telemetry, self.settings.kafka.topics.tasks}
        foreign = sorted({t for t, _ in state.offsets} - inputs)
        if foreign:
            log.error("snapshot skipped: it covers other input topics", name=name, topics=foreign)
            return None
        with self.lock:
            snapshot.install(state, self.scheduler)
        log.info("snapshot restored", name=name, devices=len(state.graph.devices), offsets=len(state.offsets))
        return state.offsets

    def write_snapshot(self) -> None:
        if self.snapshots is not None and self._ingestor is not None:
            snapshot.take(self.snapshots, self.scheduler, self._ingestor.positions, self.lock)

    async def _snapshot_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await asyncio.to_thread(self.write_snapshot)
            except OSError as exc:  # a full disk must not stop the daemon; the next try may work
                log.error("snapshot failed", error=str(exc))

    def staleness_ms(self) -> float:
        newest = self.scheduler.graph.newest_telemetry_ms
        return -1.0 if newest == 0 else max(0.0, self.clock() * 1000 - newest)

    def metrics_sample(self) -> StateSample:
        """The daemon's observed values for ``/metrics``, read under the lock at one moment."""
        with self.lock:
            state = cluster_state(self.scheduler, self.staleness_ms())
            stats = self._ingestor.stats if self._ingestor is not None else IngestStats()
            applied, rejected = stats.applied, dict(stats.rejected)
            policy = self.scheduler.policy
            waiting = self.scheduler.waiting_count
            held, forgotten = len(self.scheduler.graph.tasks), self.scheduler.forgotten_total
        return StateSample(
            serving=self.serving,
            devices=state.devices,
            hosts=state.hosts,
            pending_tasks=state.pending_tasks,
            waiting_for_device=waiting,
            running_tasks=state.running_tasks,
            last_sequence=state.last_sequence,
            staleness_s=state.staleness_ms / 1000 if state.staleness_ms >= 0 else -1.0,
            mean_utilization=state.mean_utilization,
            policy=state.policy,
            model_version=state.model_version,
            events_applied=applied,
            events_rejected=rejected,
            consumer_lag=dict(self._lag),
            degraded=state.degraded,
            model_provider=policy.provider if isinstance(policy, GnnPolicy) else "",
            tasks_held=held,
            tasks_forgotten=forgotten,
        )

    # -- running -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down in order. Raises if start-up or ingest fails."""
        topics = self.settings.kafka.topics
        grpc_settings = self.settings.grpc
        service = self._make_service()
        # Built first: a bad TLS file or a taken port fails the start before Kafka is touched.
        server = GrpcServer(
            service,
            grpc_settings.listen,
            grpc_settings.max_message_bytes,
            grpc_settings.reflection,
            tls=grpc_settings.tls,
            interceptors=[self.rate_limit, RpcMetricsInterceptor(self.metrics, lambda: self.scheduler.policy.name)],
        )
        self.port = server.port
        await asyncio.to_thread(
            self.bus.ensure_topics, [topics.telemetry, topics.tasks, topics.placements, topics.dlq], [topics.inventory]
        )
        restored = await asyncio.to_thread(self.restore_ledger)
        log.info("ledger restored", placements=restored, last_sequence=self.ledger.last_sequence)
        if self.journal_enabled:
            await asyncio.to_thread(self.open_journal)  # after the ledger topic: it fills the gaps
        start = await asyncio.to_thread(self.restore_snapshot)  # after the ledger: it binds to it
        self.ledger.subscribe(self.decisions.placement)

        inputs = [topics.telemetry, topics.tasks]
        await asyncio.to_thread(self.capture_replay_targets, inputs, start)
        source = self.bus.source(inputs, self.settings.kafka.group_id, start)
        # Dead letters and mirrored inventory are no decisions: they bypass the journal.
        dead_letters = CountingPublisher(self.raw_publisher, topics.dlq, self.metrics)
        self._ingestor = Ingestor(
            source, dead_letters, self.scheduler, self.lock, topics, self.settings.kafka.max_event_bytes
        )
        ingest = IngestThread(self._ingestor, self.settings.kafka.batch_size, self.settings.kafka.poll_timeout_s)
        self.ingest = ingest
        if self.snapshots is not None:
            self.on_shutdown_snapshot = self.write_snapshot
            self._spawn(self._snapshot_every(self.settings.snapshot.interval_s))
        if self._journaled is not None and self._answer_gate is not None:
            self._spawn(self._journal_upkeep(self._journaled, self._answer_gate))
        metrics_server: MetricsServer | None = None
        try:
            # The model loads and warms up on the restored graph before health says SERVING.
            await asyncio.to_thread(self._start_policy, self.scheduler.policy)
            await server.start()  # health NOT_SERVING until the replay below has caught up
            ingest.start()
            metrics_server = self._start_metrics(inputs)
            if await self._replay_until_caught_up(stop, ingest):
                await server.set_serving()
                self.serving = True
                self.ready.set()
                log.info(
                    "serving",
                    listen=grpc_settings.listen,
                    port=server.port,
                    tls=server.tls,
                    metrics_port=self.metrics_port or None,
                    bus=self.settings.bus,
                )
                self.notifier.ready(self._status_line())
                await self._serve_until(stop, ingest)
        finally:
            await self._shutdown(server, ingest, metrics_server)
        if ingest.failure is not None:
            raise RuntimeError("ingest failed") from ingest.failure

    async def run_shard(self, stop: asyncio.Event, announce: Callable[[bool], None]) -> None:
        """Decide for one partition of the inputs (``self.shard``) until ``stop`` is set, for an
        instance that shares the cells with others (``hlb.daemon.cells.host``, which serves the gRPC API).

        Like ``run`` without the server and the journal: the transactional producer is set up
        first (fencing the partition's previous owner and aborting what it left open), then the
        ledger is read back ``read_committed``, the newest snapshot restored and the inputs
        replayed; ``announce(True)`` once caught up, ``announce(False)`` before that. Decisions are
        committed in a transaction before an RPC that made them answers, and those made by ingest
        every ``cells.commit_interval_s``. Stops early, raising, when the producer is fenced (a new
        owner took the partition) or ingest fails.
        """
        from hlb.daemon.cells.bus import TransactionalPublisher

        assert self.shard is not None, "run_shard needs a shard"
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
        self.ledger.subscribe(self.decisions.placement)
        inputs = [topics.telemetry, topics.tasks]
        await asyncio.to_thread(self.capture_replay_targets, inputs, start)
        ingest = self._shard_ingest(inputs, start)
        self.service = self._make_service()
        if self.snapshots is not None:
            self.on_shutdown_snapshot = self.write_snapshot
            self._spawn(self._snapshot_every(self.settings.snapshot.interval_s))
        committing = asyncio.ensure_future(self._commit_every(transactions, self.settings.cells.commit_interval_s))
        failure: BaseException | None = None
        try:
            await asyncio.to_thread(self._start_policy, self.scheduler.policy)
            ingest.start()
            announce(False)
            if await self._replay_until_caught_up(stop, ingest):
                self.serving = True
                announce(True)
                log.info("shard serving", shard=self.shard, cell=self.scheduler.cell)
                stopped = asyncio.ensure_future(stop.wait())
                while not stopped.done() and not committing.done() and ingest.is_alive():
                    await asyncio.wait([stopped, committing], timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
        finally:
            self.serving = False
            _stop_policy(self.scheduler.policy)
            if committing.done() and committing.exception() is not None:
                failure = committing.exception()
            committing.cancel()
            await self._hand_over(ingest, transactions, fenced=failure is not None)
        if failure is not None:
            raise failure
        if ingest.failure is not None:
            raise RuntimeError("ingest failed") from ingest.failure

    def _shard_ingest(self, inputs: Sequence[str], start: dict[tuple[str, int], int] | None) -> IngestThread:
        kafka = self.settings.kafka
        source = self.bus.source(inputs, kafka.group_id, start)
        dead_letters = CountingPublisher(self.raw_publisher, kafka.topics.dlq, self.metrics)
        ingestor = Ingestor(source, dead_letters, self.scheduler, self.lock, kafka.topics, kafka.max_event_bytes)
        ingestor.admit = self._admit
        ingestor.pipelines[kafka.topics.tasks].insert(1, self._same_cell)
        self._ingestor = ingestor
        self.ingest = IngestThread(ingestor, kafka.batch_size, kafka.poll_timeout_s)
        return self.ingest

    def _make_service(self) -> SchedulerService:
        service = SchedulerService(self.scheduler, self.lock, self.decisions.submitted)
        service.staleness_ms = self.staleness_ms
        service.refusal = self.refusal
        service.durable = self.durable
        return service

    async def _commit_every(self, transactions: TransactionalPublisher, interval_s: float) -> None:
        """Commit what ingest decided; returns (raising) only when the producer was fenced."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(transactions.commit)

    async def _hand_over(self, ingest: IngestThread, transactions: TransactionalPublisher, *, fenced: bool) -> None:
        """Stop a shard so that the next owner starts from everything it did: ingest stops, the
        snapshot is written, the open transaction committed (unless fenced: it is not ours now)."""
        if ingest.ident is not None:
            await asyncio.to_thread(ingest.stop)
        try:
            await asyncio.to_thread(self.on_shutdown_snapshot)
        except Exception:
            log.exception("shard snapshot failed", shard=self.shard)
        if not fenced:
            undelivered = await asyncio.to_thread(transactions.flush, 10.0)
            if undelivered:
                log.error("shard handed over with decisions not committed", shard=self.shard, records=undelivered)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
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

    async def _replay_until_caught_up(self, stop: asyncio.Event, ingest: IngestThread) -> bool:
        """Wait until ingest has replayed to the start's end offsets; False when stopped (or ingest
        died) first. The watchdog is fed meanwhile: a long replay is progress, not a hang."""
        pinger = WatchdogPinger(self.notifier)
        left = self.replay_left()
        if left:
            log.info("replaying before serving", records_left=left)
        reported = 0.0
        while left:
            if stop.is_set() or not ingest.is_alive():
                return False
            now = self._monotonic()
            pinger.tick(now)
            if now - reported >= 1.0:
                self.notifier.status(f"replaying: {left} records left")
                reported = now
            await asyncio.sleep(REPLAY_CHECK_S)
            left = self.replay_left()
        return not stop.is_set() and ingest.is_alive()

    async def _journal_upkeep(self, journaled: JournaledPublisher, gate: AnswerGate) -> None:
        """Bring what ingest decided into the journal as an answer would (``gate``: written and
        fsynced by its thread, or fsynced; the API does so at once; a failure is retried here) and
        drop acknowledged records."""
        journal = journaled.journal
        next_ack = self._monotonic() + JOURNAL_ACK_S
        while True:
            await asyncio.sleep(JOURNAL_SYNC_S)
            try:
                if journal.durable < journal.appended:
                    await gate()
                if self._monotonic() >= next_ack:
                    next_ack = self._monotonic() + JOURNAL_ACK_S
                    if len(journal):
                        await asyncio.to_thread(journaled.acknowledge, 5.0)
            except OSError as exc:  # a full disk: keep trying; the RPCs report their own failures
                log.error("journal upkeep failed", error=str(exc))
                self.metrics.journal_sync_failures.inc()

    async def _serve_until(self, stop: asyncio.Event, ingest: IngestThread) -> None:
        pinger = WatchdogPinger(self.notifier)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stopped.done() and ingest.is_alive():
                # The watchdog is fed from this loop, so a stuck event loop stops the pings.
                pinger.tick(self._monotonic())
                await asyncio.wait([stopped], timeout=min(1.0, pinger.interval_s or 1.0))
        finally:
            stopped.cancel()

    async def _shutdown(self, server: GrpcServer, ingest: IngestThread, metrics_server: MetricsServer | None) -> None:
        self.serving = False
        _stop_policy(self.scheduler.policy)
        self.notifier.stopping("finishing in-flight requests")
        log.info("stopping", grace_s=self.settings.grpc.grace_s)
        await server.stop(self.settings.grpc.grace_s)  # health NOT_SERVING first, then refuse new RPCs
        self.notifier.status("storing offsets")
        if ingest.ident is not None:  # started
            await asyncio.to_thread(ingest.stop)  # the source's close() commits the stored offsets
        self.notifier.status("writing snapshot")
        snapshot_error: BaseException | None = None
        try:
            await asyncio.to_thread(self.on_shutdown_snapshot)
        except Exception as exc:
            snapshot_error = exc
            log.exception("snapshot failed")
        undelivered = await asyncio.to_thread(self.publisher.flush, 10.0)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._journaled is not None and self.journal is not None:
            if self._answer_gate is not None:
                await asyncio.to_thread(self._answer_gate.close)
            if not undelivered:  # the broker has everything: the journal may be emptied
                await asyncio.to_thread(self._journaled.acknowledge, 1.0)
            await asyncio.to_thread(self.journal.close)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.stop)
        applied = self._ingestor.stats.applied if self._ingestor is not None else 0
        log.info("stopped", undelivered=undelivered, applied=applied)
        if snapshot_error is not None:
            raise RuntimeError("the shutdown snapshot failed") from snapshot_error

    def _start_metrics(self, inputs: Sequence[str]) -> MetricsServer | None:
        self.metrics.observe(self.metrics_sample)
        metrics_server = start_metrics_server(self.metrics, self.settings.metrics.listen)
        if metrics_server is None:
            return None
        self.metrics_port = metrics_server.port
        probe = self._lag_probe(inputs)
        if probe is not None:
            self._spawn(self._watch_lag(probe, self.settings.metrics.lag_interval_s))
        return metrics_server

    def _lag_probe(self, inputs: Sequence[str]) -> LagProbe | None:
        if isinstance(self.bus, MemoryBus):
            return MemoryLagProbe(self.bus, inputs, self.settings.kafka.group_id)
        if self.settings.bus == "kafka":
            return KafkaLagProbe(self.settings.kafka, inputs, self.settings.kafka.group_id)
        return None

    async def _watch_lag(self, probe: LagProbe, interval_s: float) -> None:
        failing = False
        try:
            while True:
                try:
                    self._lag = await asyncio.to_thread(probe.read)
                except Exception as exc:  # the broker is away: keep the last figures, say so once
                    if not failing:
                        log.warning("consumer lag unavailable", error=str(exc))
                    failing = True
                else:
                    failing = False
                await asyncio.sleep(interval_s)
        finally:
            probe.close()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _status_line(self) -> str:
        return f"serving on {self.settings.grpc.listen}, ledger at sequence {self.ledger.last_sequence}"

    # -- reload ------------------------------------------------------------------------------

    def request_reload(self) -> None:
        """Schedule a reload on the running loop (the SIGHUP handler)."""
        self._spawn(self.reload())

    async def reload(self) -> ReloadResult:
        """Re-read the config file and apply what can change while running; see the module docstring."""
        async with self._reload_lock:
            self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
            try:
                result = await self._reload()
                policy = self.scheduler.policy
                if isinstance(policy, GnnPolicy):  # SIGHUP also looks at the model files again
                    await asyncio.to_thread(policy.reload_model, True)
            finally:
                self.notifier.ready(self._status_line())
            return result

    async def _reload(self) -> ReloadResult:
        try:
            new = await asyncio.to_thread(load_settings, self.config_path)
        except Exception as exc:  # whatever stops the load: a SIGHUP must not end in a task that died
            error = str(exc) if isinstance(exc, ConfigError) else f"config file {self.config_path}: {exc!r}"
            log.error("reload refused: the config does not load; the running config is kept", error=error)
            self.metrics.reloads.labels(result="invalid").inc()
            return ReloadResult(error=error)
        old = self.settings
        changed = changed_keys(old, new)
        by_reloader: dict[Reloader, list[str]] = {}
        needs_restart: list[str] = []
        for key in changed:
            reloader = self._reloader_for(key)
            if reloader is None:
                needs_restart.append(key)
            else:
                by_reloader.setdefault(reloader, []).append(key)
        applied: list[str] = []
        failed: list[str] = []
        effective = old
        for reloader, keys in by_reloader.items():
            try:
                await asyncio.to_thread(reloader, new)  # a model load must not stall the RPCs
            except Exception as exc:
                log.error("reload of some keys failed; their running values are kept", keys=keys, error=str(exc))
                failed += keys
            else:
                applied += keys
                for key in keys:
                    effective = replace_key(effective, key, _get_key(new, key))
        self.settings = effective
        if needs_restart:
            log.warning("changed keys cannot be reloaded; restart to apply them", keys=needs_restart)
        log.info("reloaded", applied=applied, needs_restart=needs_restart, failed=failed)
        outcome = "unchanged" if not changed else "partial" if needs_restart or failed else "applied"
        self.metrics.reloads.labels(result=outcome).inc()
        return ReloadResult(tuple(applied), tuple(needs_restart), tuple(failed))

    def _reloader_for(self, key: str) -> Reloader | None:
        if key in self.restart_only:
            return None
        matches = [p for p in self.reloaders if key == p or (p.endswith(".") and key.startswith(p))]
        return self.reloaders[max(matches, key=len)] if matches else None

    def _reload_logging(self, new: Settings) -> None:
        configure_logging(new.log.level, new.log.format)

    def _make_policy(self, settings: Settings) -> Policy:
        s = settings.scheduler
        if s.policy == "gnn":
            weights = ObjectiveWeights.of(s.weights.model_dump())
            return GnnPolicy(settings.model, weights, on_fallback=self.metrics.record_fallback)
        return make_policy(s.policy, s.weights.model_dump(), s.seed)

    def _start_policy(self, policy: Policy) -> None:
        """Load and warm up a GNN's model on the current graph and start its refresh thread."""
        if isinstance(policy, GnnPolicy):
            policy.start(self.scheduler.graph, self.lock)

    def _reload_scheduler(self, new: Settings) -> None:
        policy = self._make_policy(new)
        self._start_policy(policy)  # before it decides anything
        with self.lock:
            old, self.scheduler.policy = self.scheduler.policy, policy
            self.scheduler.keep_ended_s = new.scheduler.keep_ended_s
            self.scheduler.remember_ended = new.scheduler.remember_ended
        _stop_policy(old)

    def _reload_model(self, new: Settings) -> None:
        """New model settings: the running GNN loads and checks the model before it switches;
        raises (keeping the running model) when the new one is unusable."""
        policy = self.scheduler.policy
        if isinstance(policy, GnnPolicy) and new.scheduler == self.settings.scheduler:
            policy.configure(new.model)

    def _reload_rate_limit(self, new: Settings) -> None:
        bucket = self.rate_limit.bucket
        rate, burst = new.grpc.max_requests_per_s, new.grpc.request_burst
        if rate <= 0:
            self.rate_limit.bucket = None
        elif bucket is None:
            self.rate_limit.bucket = _bucket(new, self._monotonic)
        else:
            bucket.configure(rate, default_burst(rate, burst))


class DecisionPublisher:
    """What the daemon publishes as its own decisions: each placement the ledger records (topic
    ``placements``, counted by policy in ``hlb_placements``) and each task submitted through the
    API (topic ``tasks``, a ``submitted`` event of the scheduler's cell). ``publisher`` is replaced
    when the journal opens (``Daemon.open_journal``) or a shard's transactions start.
    ``hlb bench latency --journal`` publishes through this class too."""

    def __init__(
        self,
        publisher: Publisher,
        topics: Topics,
        scheduler: Scheduler,
        clock: Callable[[], float],
        placements: Counter,
    ) -> None:
        self.publisher = publisher
        self._topics = topics
        self._scheduler = scheduler
        self._clock = clock
        self._placements = placements
        self._placements_of: dict[str, Counter] = {}  # the counter's child per policy, looked up once

    def placement(self, placement: ev.Placement) -> None:
        self.publisher.publish(self._topics.placements, placement.cell.encode(), placement.SerializeToString())
        counter = self._placements_of.get(placement.policy)
        if counter is None:
            counter = self._placements_of[placement.policy] = self._placements.labels(policy=placement.policy)
        counter.inc()

    def submitted(self, spec: ev.TaskSpec) -> None:
        cell = self._scheduler.cell
        event = ev.TaskEvent(cell=cell, event_time_ms=int(self._clock() * 1000), submitted=spec)
        self.publisher.publish(self._topics.tasks, cell.encode(), event.SerializeToString())


def _stop_policy(policy: Policy) -> None:
    if isinstance(policy, GnnPolicy):
        policy.stop()


class CountingPublisher:
    """The ingest path's publisher: passes everything on and counts what goes to the dead-letter topic."""

    def __init__(self, inner: Publisher, dlq_topic: str, metrics: DaemonMetrics) -> None:
        self._inner = inner
        self._dlq_topic = dlq_topic
        self._metrics = metrics

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        self._inner.publish(topic, key, value, headers)
        if topic == self._dlq_topic:
            source = dict(headers).get("hlb.source.topic", b"").decode("utf-8", "replace")
            self._metrics.dead_letters.labels(topic=source).inc()

    def flush(self, timeout_s: float) -> int:
        return self._inner.flush(timeout_s)


def _bucket(settings: Settings, clock: Callable[[], float]) -> TokenBucket | None:
    rate = settings.grpc.max_requests_per_s
    return TokenBucket(rate, default_burst(rate, settings.grpc.request_burst), clock) if rate > 0 else None


# -- settings as dotted keys ---------------------------------------------------------------------


def flatten(model: BaseModel, prefix: str = "") -> dict[str, object]:
    """Leaf values of ``model`` by dotted key (``grpc.tls.cert_file``); dicts are leaves."""
    leaves: dict[str, object] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            leaves.update(flatten(value, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = value
    return leaves


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """Dotted keys whose values differ (secrets compare by value, and are never returned)."""
    before, after = flatten(old), flatten(new)
    return [key for key in after if before.get(key) != after[key]]


def replace_key(model: Any, key: str, value: object) -> Any:
    """A copy of frozen ``model`` with the dotted ``key`` set to ``value``."""
    head, _, rest = key.partition(".")
    if not rest:
        return model.model_copy(update={head: value})
    return model.model_copy(update={head: replace_key(getattr(model, head), rest, value)})


def _get_key(model: Any, key: str) -> object:
    for part in key.split("."):
        model = getattr(model, part)
    return model


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run the hlb daemon: consume events, place tasks, serve the gRPC API."
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"YAML config file (default: $CONFIGURATION_DIRECTORY/config.yaml or {default_config_path()})",
    )


def run(args: argparse.Namespace) -> int:
    path: Path = args.config or default_config_path()
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"hlb: {exc}", file=sys.stderr)
        return EX_CONFIG
    configure_logging(settings.log.level, settings.log.format)
    return asyncio.run(_serve(settings, path))


async def _serve(settings: Settings, config_path: Path | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if settings.cells.enabled:
        from hlb.daemon.cells.host import CellHost

        run = CellHost(settings).run
        loop.add_signal_handler(
            signal.SIGHUP, lambda: log.warning("reload is not supported with cells.enabled; restart the instance")
        )
        loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning("the state dump is not written with cells.enabled"))
    else:
        daemon = Daemon(settings, make_bus(settings), config_path=config_path)
        run = daemon.run
        loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
        # SIGUSR1 writes the canonical state dump, for operators and the fault-injection tests.
        loop.add_signal_handler(signal.SIGUSR1, lambda: loop.run_in_executor(None, daemon.dump_state))
    try:
        await run(stop)
    except ConfigError as exc:
        log.error("invalid configuration", error=str(exc))
        return EX_CONFIG
    except (BrokerError, OSError) as exc:
        log.error("daemon failed", error=str(exc))
        return 1
    except Exception:
        log.exception("daemon failed")
        return 1
    return 0
