"""The daemon, wired from its parts, and its life as a service (``hlb serve``, ``hlb.daemon.main``).

Start-up: check the gRPC listener and its TLS files, restore the placement ledger from its
topic, then the decisions of the journal (``hlb.daemon.record.journal``) that the topic lacks (published
again), then the newest snapshot (``hlb.daemon.runtime.restore``); note the input topics' end offsets
(high watermarks) now; start ingest on its own thread, the gRPC server and the metrics endpoint.
Health stays NOT_SERVING, and the deciding RPCs answer UNAVAILABLE, until ingest has replayed the
inputs up to those end offsets: only then does the graph hold everything decided and submitted
before the start. Then SERVING (health) and READY=1 (systemd).

With the Kafka bus, every decision is in the journal before the RPC that made it answers
(``Daemon.durable``), and before the producer has it: in the file, fsynced off the request path
(``journal.sync: write``), or on disk (``fsync``). Either way a SIGKILL cannot make the
restarted daemon forget an answer; with ``fsync`` neither can the machine going down.

When the journal does not take a write (or, with ``fsync``, an fsync): a full disk, an I/O
error. The decisions not committed yet are withdrawn and undone
(``hlb.daemon.runtime.durability``), the RPC that waited for them answers UNAVAILABLE, and until
the journal takes data again (tried every ``JOURNAL_PROBE_S``) health is NOT_SERVING,
``hlb_serving`` and ``hlb_journal_writable`` are 0 and the deciding RPCs are refused
(``refusal``). Then the daemon serves again by itself. The episode is logged when it starts and
when it ends.

SIGTERM or SIGINT, in this order: STOPPING=1 and health NOT_SERVING; the gRPC server refuses new
RPCs and gives in-flight ones ``grpc.grace_s``; ingest stops, which stores and commits the
offsets of everything applied; ``Daemon.on_shutdown_snapshot`` runs (the snapshot seam); the
producer flushes what is still queued; the metrics endpoint closes last. Exit code 0.

SIGHUP re-reads the config file (``Daemon.reload``; ``hlb.daemon.runtime.reload``), and the
access policy file (``auth.policy_file``; ``hlb.daemon.serve.auth``) whether or not a key changed.

Longer than hlb's modules usually are, on purpose: the wiring of every part and the order of the
start, the serving and the stop are one story; restore, reload, the policy, publishing and the
durability of decisions are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import structlog
from grpc_health.v1 import health_pb2

from hlb.daemon.bus.lag import Lag
from hlb.daemon.bus.seam import EventBus, EventSource, MemoryBus, Offsets, Publisher
from hlb.daemon.config import Settings
from hlb.daemon.decide.fgd import cluster_fragmentation_gpus
from hlb.daemon.decide.leases import LeaseTimeouts
from hlb.daemon.decide.scheduler import Clock, Scheduler
from hlb.daemon.errors import ConfigError
from hlb.daemon.ingest.backlog import TenantBacklog
from hlb.daemon.ingest.pipeline import Ingestor, IngestStats, IngestThread
from hlb.daemon.record import snapshot
from hlb.daemon.record.answers import AnswerGate, JournaledPublisher
from hlb.daemon.record.features import FeatureLog
from hlb.daemon.record.journal import PROBE_BYTES, JournalFile, NotDurableError
from hlb.daemon.record.shadow import Shadow
from hlb.daemon.record.statedump import canonical_state, write_dump
from hlb.daemon.runtime.durability import FailureEpisode, describe, withdraw_decisions
from hlb.daemon.runtime.lifecycle import DaemonModels, LifecycleMetrics, LifecycleThread, ModelLifecycle
from hlb.daemon.runtime.metrics import (
    DaemonMetrics,
    MetricsServer,
    RpcMetricsInterceptor,
    StateSample,
    lag_probe,
    start_metrics_server,
    watch_lag,
)
from hlb.daemon.runtime.policy import (
    build_policy,
    has_model,
    model_provider,
    model_scorer,
    reload_model_files,
    shadow_scorer,
    start_policy,
    stop_policy,
)
from hlb.daemon.runtime.publish import CountingPublisher, DecisionPublisher
from hlb.daemon.runtime.reload import (
    Reloader,
    ReloadResult,
    apply_settings,
    model_reloader,
    rate_limit_reloader,
    reload_logging,
    reload_settings,
    reloader_for,
    scheduler_reloader,
    token_bucket,
)
from hlb.daemon.runtime.restore import (
    ReplayProgress,
    ReplayTargets,
    newest_snapshot,
    read_ledger,
    read_watermarks,
    replay_targets,
    restore_journal,
    wait_for_replay,
)
from hlb.daemon.runtime.sdnotify import SystemdNotifier, WatchdogPinger
from hlb.daemon.serve.api import SERVICE_NAME, GrpcServer, SchedulerService, cluster_state
from hlb.daemon.serve.auth import Access
from hlb.daemon.serve.extender import Extender, ExtenderServer
from hlb.daemon.serve.interceptors import OwnCellOnly
from hlb.daemon.serve.ratelimit import RateLimitInterceptor
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

# The keys and sections a running daemon reloads (``Daemon.reloaders``), and those keys under them
# it cannot: an instance sharing the cells has each shard apply them (``hlb.daemon.cells.host``).
RELOADED = ("log.", "scheduler.", "model.", "grpc.max_requests_per_s", "grpc.request_burst", "auth.", "leases.")
RESTART_ONLY = frozenset({"scheduler.max_tasks_per_device", "leases.check_interval_s"})

JOURNAL_SYNC_S = 0.05  # decisions made by ingest reach the disk at least this often (the API's at once)
JOURNAL_ACK_S = 1.0  # how often acknowledged records are dropped from the journal
JOURNAL_PROBE_S = 1.0  # while the journal takes nothing: how often it is tried again


def make_bus(settings: Settings) -> EventBus:
    if settings.bus == "memory":
        return MemoryBus()
    from hlb.daemon.bus.kafka import KafkaBus  # librdkafka loads only when Kafka is used

    return KafkaBus(settings.kafka)


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
        notifier: SystemdNotifier | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.clock = clock
        self.config_path = config_path
        self.lock = threading.RLock()
        self.ledger = PlacementLedger()
        self.extender_server: ExtenderServer | None = None  # the Kubernetes scheduler extender, when on
        self.metrics = DaemonMetrics(input_topics=(settings.kafka.topics.telemetry, settings.kafka.topics.tasks))
        policy = build_policy(settings, self.metrics.record_fallback)
        self.scheduler = Scheduler(
            InfraGraph(settings.scheduler.max_tasks_per_device),
            policy,
            self.ledger,
            settings.cell,
            clock,
            keep_ended_s=settings.scheduler.keep_ended_s,
            remember_ended=settings.scheduler.remember_ended,
            max_pending=settings.scheduler.max_pending,
            lease_timeouts=LeaseTimeouts(
                settings.leases.start_timeout_s, settings.leases.report_timeout_s, settings.leases.retries
            ),
        )
        self.raw_publisher = bus.publisher()
        self.decisions = DecisionPublisher(
            self.raw_publisher, settings.kafka.topics, self.scheduler, clock, self.metrics.placements
        )
        self.decisions.unpublished = self.metrics.decisions_unpublished
        self.features = self._feature_log(settings, bus)
        self.shadow = self._shadow(settings)
        self.lifecycle = self._lifecycle(settings)
        self._lifecycle_thread: LifecycleThread | None = None
        # The journal: on by default with Kafka (a memory bus ends with the process anyway).
        self.journal_enabled = settings.bus == "kafka"
        self.journal: JournalFile | None = None
        self._answer_gate: AnswerGate | None = None
        self._journaled: JournaledPublisher | None = None
        # False while the journal takes nothing (a full disk): decisions are refused, NOT_SERVING.
        self.journal_writable = True
        self._journal_trouble = FailureEpisode(
            "decisions refused: the decision journal cannot be written; tried again every second",
            "the decision journal is written again; deciding",
            monotonic,
        )
        self._upkeep_wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: GrpcServer | None = None
        # Input partitions -> the offset replay must reach before the daemon serves (see run()).
        self.replay_targets: ReplayTargets = {}
        self.replay_progress = ReplayProgress()  # how fast replay goes: how long the rest should take
        self.ready = asyncio.Event()
        self.port = 0
        self.metrics_port = 0
        self.notifier = notifier if notifier is not None else SystemdNotifier()
        self.serving = False
        self.on_shutdown_snapshot: Callable[[], None] = lambda: None
        self.rate_limit = RateLimitInterceptor(token_bucket(settings, monotonic), self.metrics.count_rate_limited)
        reload_rate_limit = rate_limit_reloader(self.rate_limit, monotonic)
        self.access = Access.from_settings(settings)  # a policy file that does not load: ConfigError
        self.tenant_backlog = TenantBacklog(self.scheduler, self.access.tenant_of)
        self.tenant_backlog.on_refused = self.metrics.tenant_pending_refused.inc
        self.reloaders: dict[str, Reloader] = {
            "log.": reload_logging,
            "scheduler.": self._tell_lifecycle(
                self._reattach_shadow(scheduler_reloader(self.scheduler, self.lock, self.metrics.record_fallback))
            ),
            "model.": self._tell_lifecycle(model_reloader(self.scheduler, lambda: self.settings)),
            "grpc.max_requests_per_s": reload_rate_limit,
            "grpc.request_burst": reload_rate_limit,
            "auth.": self.access.reload,
            "leases.": self._reload_leases,
        }
        # Keys under a reloader's section that it cannot apply: the graph is built with them.
        self.restart_only = RESTART_ONLY
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

    def _feature_log(self, settings: Settings, bus: EventBus) -> FeatureLog | None:
        """With ``learning.log_features``: the log of the GNN's decisions (``hlb.daemon.record.features``),
        on a producer of its own so that the ledger's records never queue behind features (a shard's
        too: its ledger goes through transactions, its features need none)."""
        learning = settings.learning
        if not learning.log_features:
            return None
        if settings.scheduler.policy != "gnn":
            log.warning(
                "learning.log_features is on but only the gnn policy's decisions are logged",
                policy=settings.scheduler.policy,
            )
        return FeatureLog(
            self.scheduler,
            bus.publisher(),
            learning.topic,
            top_k=learning.top_k,
            queue_size=learning.queue_size,
            on_outcome=self.metrics.count_feature_record,
            lock=self.lock,  # records are built while no decision holds it
            max_record_bytes=settings.kafka.max_event_bytes,
        )

    def _shadow(self, settings: Settings) -> Shadow | None:
        """With ``learning.shadow_model``: the candidate GNN scored beside the running one
        (``hlb.daemon.record.shadow``), loaded and started with the running one."""
        path = settings.learning.shadow_model
        running = model_scorer(self.scheduler.policy)
        if path is None:
            return None
        candidate = shadow_scorer(settings, path)
        if running is None or candidate is None:
            log.warning("learning.shadow_model needs scheduler.policy gnn: no shadow", policy=settings.scheduler.policy)
            return None
        shadow = Shadow(candidate, self.metrics.observe_shadow_error)
        shadow.attach(running)
        shadow.listen(self.scheduler, lambda: model_scorer(self.scheduler.policy))
        return shadow

    def _lifecycle(self, settings: Settings) -> ModelLifecycle | None:
        """With ``learning.auto_models``: the lifecycle of the models on the models topic
        (``hlb.daemon.runtime.lifecycle``), told of every finished task."""
        if not settings.learning.auto_models:
            return None
        if model_scorer(self.scheduler.policy) is None:
            log.warning("learning.auto_models needs scheduler.policy gnn: off", policy=settings.scheduler.policy)
            return None
        models = DaemonModels(settings, self.scheduler, self.lock, self.metrics.observe_shadow_error)
        metrics = LifecycleMetrics(self.metrics.registry)
        lifecycle = ModelLifecycle(
            settings, models, self.raw_publisher, clock=self.clock, metrics=metrics, cell=lambda: self.scheduler.cell
        )

        def finished(task: Task, rows: Rows, ran_s: float, ended_s: float) -> None:
            counted = models.finished(task, rows, ran_s, ended_s)
            if counted is not None:
                lifecycle.finished(counted)

        self.scheduler.finish_listeners.append(finished)
        return lifecycle

    def _start_lifecycle(self) -> None:
        """Read the models topic from its start (a group of this process's own: it commits nothing)."""
        if self.lifecycle is None:
            return
        group = f"{self.settings.kafka.group_id}.models.{self.scheduler.cell}.{uuid.uuid4().hex[:12]}"
        source = self.models_source([self.settings.learning.models_topic], group)
        self._lifecycle_thread = LifecycleThread(self.lifecycle, source)
        self._lifecycle_thread.start()

    def models_source(self, topics: list[str], group: str) -> EventSource:
        """Where the lifecycle reads the models topic: the daemon's bus (a shard's reads all of it)."""
        return self.bus.source(topics, group)

    def stop_lifecycle(self) -> None:
        """Stop the lifecycle's thread and unload its candidate (at shutdown)."""
        if self._lifecycle_thread is not None:
            self._lifecycle_thread.stop()
            self._lifecycle_thread = None
        if self.lifecycle is not None:
            self.lifecycle.models.drop_candidate()

    def _tell_lifecycle(self, reload: Reloader) -> Reloader:
        """``reload`` (which loads ``model.path``'s model), then the model lifecycle installs the
        topic's version again (``ModelLifecycle.policy_reloaded``)."""

        def reload_and_tell(new: Settings) -> None:
            reload(new)
            if self.lifecycle is not None:
                self.lifecycle.policy_reloaded()

        return reload_and_tell

    def _reattach_shadow(self, reload: Reloader) -> Reloader:
        """``reload`` (the scheduler's, which builds a new policy), then the shadow listens to the new one."""

        def reload_and_reattach(new: Settings) -> None:
            reload(new)
            running = model_scorer(self.scheduler.policy)
            if self.shadow is not None and running is not None:
                self.shadow.attach(running)

        return reload_and_reattach

    @property
    def publisher(self) -> Publisher:
        """Where the daemon's decisions go: the bus's publisher, journaled once run() opens the
        journal, or a shard's transactions (``hlb.daemon.cells.shard``)."""
        return self.decisions.publisher

    @publisher.setter
    def publisher(self, publisher: Publisher) -> None:
        self.decisions.publisher = publisher

    # -- restoring (hlb.daemon.runtime.restore) ----------------------------------------------

    def set_up_topics(self) -> None:
        """Create the missing topics; on Kafka, refuse (``ConfigError``, naming the setting) topics
        that would lose what a start reads back: the ledger's decisions, the compacted inventory."""
        topics = self.settings.kafka.topics
        plain = [topics.telemetry, topics.tasks, topics.placements, topics.dlq]
        if self.settings.learning.log_features:
            plain.append(self.settings.learning.topic)
        compacted = [topics.inventory]
        if self.settings.learning.auto_models:
            compacted.append(self.settings.learning.models_topic)
        self.bus.ensure_topics(plain, compacted)
        if self.settings.bus == "kafka":
            from hlb.daemon.bus.topics import require_kept  # librdkafka loads only when Kafka is used

            require_kept(self.settings)

    def restore_ledger(self) -> int:
        """Load earlier decisions so that a replayed submission is not placed twice."""
        placements = read_ledger(self.bus, self.settings.kafka)
        with self.lock:
            return self.ledger.restore(placements)

    def open_journal(self) -> int:
        """Open the journal, restore its decisions the ledger lacks and publish them again; returns
        how many were restored. Runs after ``restore_ledger`` and before anything is replayed."""
        journal = JournalFile.open(self.settings.state_dir)
        self.journal = journal
        sync = self.settings.journal.sync
        self._answer_gate = AnswerGate(journal, sync, on_failure=lambda _: self.metrics.journal_sync_failures.inc())
        self._journaled = JournaledPublisher(
            self.raw_publisher, journal, sync, sequence_of=self._sequence_of, on_waiting=self._wake_upkeep
        )
        self._journaled.on_refused = lambda _: self.metrics.handover_failures.inc()
        self.publisher = self._journaled
        if journal.skipped:
            self.metrics.journal_records_skipped.inc(len(journal.skipped))
        with self.lock:
            return restore_journal(
                journal.recovered, self.ledger, self.raw_publisher, self.settings.kafka, journal.highest_sequence
            )

    def _sequence_of(self, topic: str, value: bytes) -> int:
        """The number a journal record's header carries: a placement's ledger sequence."""
        if topic != self.settings.kafka.topics.placements:
            return 0
        sequence: int = ev.Placement.FromString(value).sequence
        return sequence

    def _wake_upkeep(self) -> None:
        """A decision waits for the journal (made by ingest, on its thread): have the upkeep write it."""
        loop, wake = self._loop, self._upkeep_wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(wake.set)

    def restore_snapshot(self) -> Offsets | None:
        """Install the newest valid snapshot; returns the input offsets it covers (None: replay all)."""
        if self.snapshots is None:
            return None
        topics = self.settings.kafka.topics
        found = newest_snapshot(self.snapshots, {topics.telemetry, topics.tasks})
        if found is None:
            return None
        name, state = found
        with self.lock:
            snapshot.install(state, self.scheduler)
        log.info("snapshot restored", name=name, devices=len(state.graph.devices), offsets=len(state.offsets))
        return state.offsets

    def capture_replay_targets(self, inputs: Sequence[str], start: Offsets | None) -> None:
        """Note, per input partition, the end offset replay must reach: its high watermark now,
        unless the consumer begins at or past it (a snapshot's offsets, or a memory bus group's)."""
        marks = read_watermarks(self.bus, self.settings, inputs)
        if marks is not None:
            self.replay_targets = replay_targets(marks, start, self.bus, self.settings.kafka.group_id)

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
        if not self.journal_writable:
            return (
                "decisions cannot be made durable: the decision journal cannot be written "
                f"({self._journal_trouble.error}); refused until it can"
            )
        if self.serving:
            return None
        left = self.replay_left() if self.replay_targets else 0
        if left:
            return (
                f"replaying the inputs after a start: {self.replay_progress.describe(left)} before decisions"
                " are served (placements decided before the start are answered meanwhile)"
            )
        return "the daemon is not serving (starting or stopping)"

    # -- state, durability and what is observed ---------------------------------------------

    async def durable(self) -> None:
        """Wait until every decision made so far is in the journal, on disk or in the file as
        ``journal.sync`` says (group commit). ``NotDurableError`` (an ``OSError``) when the journal
        does not take them: they are undone by then (``_journal_failed``)."""
        gate = self._answer_gate
        if gate is None:
            return
        try:
            await gate()
        except OSError as exc:
            await self._journal_failed(exc)
            why = self._journal_trouble.error or describe(exc)
            raise NotDurableError(
                f"decisions cannot be made durable: the decision journal cannot be written ({why}); "
                "nothing was decided, try again later"
            ) from exc

    async def _journal_failed(self, exc: OSError) -> None:
        """The journal did not take a write or fsync: refuse decisions (NOT_SERVING) until it does
        again, and undo every decision it has not committed."""
        self.metrics.journal_sync_failures.inc()
        self.journal_writable = False  # at once: handlers that run while this waits are refused
        with self.lock:
            self.scheduler.passes_held = True  # ingest's passes would only decide what is undone
        if self._journal_trouble.failed(exc, path=str(self.journal.path) if self.journal else None):
            self.notifier.status(f"not serving: the decision journal cannot be written ({self._journal_trouble.error})")
            await self._publish_health()
        await asyncio.to_thread(self._withdraw_uncommitted)

    def _withdraw_uncommitted(self) -> None:
        """Cut the records the journal has not committed off it and undo their decisions."""
        if self._journaled is None:
            return
        with self.lock:
            records = self._journaled.withdraw()
            if not records:
                return
            undone = withdraw_decisions(self.scheduler, records, self.settings.kafka.topics)
        withdrawn = self.metrics.decisions_withdrawn
        withdrawn.labels(kind="placement").inc(len(undone.placements))
        withdrawn.labels(kind="submission").inc(len(undone.submissions))

    async def _journal_works_again(self, gate: AnswerGate) -> None:
        """While the journal takes nothing: try it (room for more than a few records, then what
        ingest decided meanwhile); serve again once it works."""
        journal = gate.journal
        try:
            await asyncio.to_thread(journal.probe, PROBE_BYTES, gate.mode == "fsync")
            await gate()
        except OSError as exc:
            await self._journal_failed(exc)  # counted, not logged again; what ingest decided is undone
            return
        with self.lock:
            self.scheduler.passes_held = False
            self.scheduler.reconsider()  # the tasks queued again are decided now
        self.journal_writable = True
        self._journal_trouble.ended()
        await self._publish_health()
        if self.serving:
            self.notifier.status(self._status_line())

    async def _publish_health(self) -> None:
        """Health as the daemon stands: SERVING once caught up and while the journal takes decisions."""
        server = self._server
        if server is None:
            return
        status = health_pb2.HealthCheckResponse.SERVING
        if not (self.serving and self.journal_writable):
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await server.health.set(name, status)

    def dump_state(self) -> Path | None:
        """Write the canonical state dump (``hlb.daemon.record.statedump``) to the state directory;
        None when it cannot be written (a full disk: logged, the last good dump kept)."""
        with self.lock:
            state = canonical_state(self.scheduler)
            if self._ingestor is not None:
                stats = self._ingestor.stats
                state["ingest"] = {"applied": stats.applied, "rejected": dict(stats.rejected)}
            labels = self.dump_labels()
            state.update(labels)
        try:
            path = write_dump(state, self.settings.state_dir)
        except OSError as exc:
            log.error("state dump not written", error=str(exc), **labels)
            return None
        log.info("state dumped", path=str(path))
        return path

    def dump_labels(self) -> dict[str, Any]:
        """What the state dump says of whose state it is, beside the state (a shard: its cell)."""
        return {}

    def write_snapshot(self) -> None:
        if self.snapshots is not None and self._ingestor is not None:
            snapshot.take(self.snapshots, self.scheduler, self._ingestor.positions, self.lock)

    async def _snapshot_every(self, interval_s: float) -> None:
        trouble = FailureEpisode(
            "snapshot failed; tried again every snapshot.interval_s, logged again once one is written",
            "snapshot written again",
            self._monotonic,
        )
        while True:
            await asyncio.sleep(interval_s)
            if not self.journal_writable:  # the state may hold decisions about to be withdrawn
                continue
            try:
                await asyncio.to_thread(self.write_snapshot)
            except OSError as exc:  # a full disk must not stop the daemon; the next try may work
                self.metrics.snapshot_failures.inc()
                trouble.failed(exc)
                continue
            trouble.ended()

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
            max_pending, queue_full = self.scheduler.max_pending, self.scheduler.refused_queue_full
            dead_letter_failures = stats.dead_letter_failures
            leases = self.scheduler.leases
            leases_held, expired, reconciled = len(leases.table), dict(leases.expired), dict(leases.reconciled)
            allocated = self.scheduler.graph.allocated_by_model()
            fragmentation = cluster_fragmentation_gpus(self.scheduler.graph)
        return StateSample(
            serving=self.serving and self.journal_writable,
            journal_writable=self.journal_writable,
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
            model_provider=model_provider(policy),
            tasks_held=held,
            tasks_forgotten=forgotten,
            max_pending=max_pending,
            refused_queue_full=queue_full,
            dead_letter_failures=dead_letter_failures,
            leases_held=leases_held,
            leases_expired=expired,
            tasks_reconciled=reconciled,
            devices_allocated=allocated,
            fragmentation_gpus=fragmentation,
        )

    # -- leases (hlb.daemon.decide.leases) ------------------------------------------------------

    def expire_leases(self) -> int:
        """Take back the placements whose lease came due, publish their ``lost`` events (the
        tasks topic, so that a replay reaches the same state) and place what the freed devices
        allow; returns how many placements were lost."""
        with self.lock:
            lost = self.scheduler.expire_leases(self.clock())
            if not lost:
                return 0
            for event in lost:
                self.decisions.lost(event)
                log.warning(
                    "placement lost",
                    task_id=event.lost.task_id,
                    sequence=event.lost.placement_sequence,
                    resubmitted=event.lost.resubmitted,
                    reason=event.lost.reason,
                )
            placed = self.scheduler.schedule_pending()
            self.decisions.take_back()
        if placed:
            log.info("placed", count=len(placed), sequence=placed[-1].sequence)
        return len(lost)

    def _reload_leases(self, new: Settings) -> None:
        """New lease timeouts and retries, for the leases granted from now on (those held keep
        their deadlines)."""
        leases = new.leases
        with self.lock:
            self.scheduler.leases.timeouts = LeaseTimeouts(
                leases.start_timeout_s, leases.report_timeout_s, leases.retries
            )

    async def _expire_leases_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self.journal_writable:  # else the lost events could not be made durable
                await asyncio.to_thread(self.expire_leases)

    # -- running -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then shut down in order. Raises if start-up or ingest fails."""
        topics = self.settings.kafka.topics
        grpc_settings = self.settings.grpc
        service = self._make_service()
        self._loop = asyncio.get_running_loop()
        self._upkeep_wake = asyncio.Event()
        # Built first: a bad TLS file or a taken port fails the start before Kafka is touched.
        server = GrpcServer(
            service,
            grpc_settings.listen,
            grpc_settings.max_message_bytes,
            grpc_settings.reflection,
            tls=grpc_settings.tls,
            interceptors=[
                self.rate_limit,
                RpcMetricsInterceptor(self.metrics, lambda: self.scheduler.policy.name),
                # One instance, one cell: another cell's requests are refused.
                OwnCellOnly(self.settings.cell, lambda: self.settings.limits.text_bytes),
            ],
        )
        self.port = server.port
        self._server = server
        self.access.announce()
        await asyncio.to_thread(self.set_up_topics)
        restored = await asyncio.to_thread(self.restore_ledger)
        log.info("ledger restored", placements=restored, last_sequence=self.ledger.last_sequence)
        if self.journal_enabled:
            await asyncio.to_thread(self.open_journal)  # after the ledger topic: it fills the gaps
        start = await asyncio.to_thread(self.restore_snapshot)  # after the ledger: it binds to it
        self._follow_ledger()

        inputs = [topics.telemetry, topics.tasks]
        await asyncio.to_thread(self.capture_replay_targets, inputs, start)
        source = self.bus.source(inputs, self.settings.kafka.group_id, start)
        # Dead letters and mirrored inventory are no decisions: they bypass the journal.
        dead_letters = CountingPublisher(self.raw_publisher, topics.dlq, self.metrics)
        kafka = self.settings.kafka
        self._ingestor = Ingestor(
            source,
            dead_letters,
            self.scheduler,
            self.lock,
            topics,
            kafka.max_event_bytes,
            limits=self.settings.limits,
            dead_letter_max_bytes=kafka.dead_letter_max_bytes,
            tenants=self.access.task_event_refusal,
            backlog=self.tenant_backlog,
            cell=self.settings.cell,
        )
        self._ingestor.after_pass = self.decisions.take_back
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
            await asyncio.to_thread(self._start_policy)
            await server.start()  # health NOT_SERVING until the replay below has caught up
            ingest.start()
            metrics_server = self._start_endpoints(inputs)
            if await self._replay_until_caught_up(stop, ingest):
                # Leases come due only once the replay has rebuilt every placement and start.
                self._spawn(self._expire_leases_every(self.settings.leases.check_interval_s))
                self.serving = True
                await self._publish_health()
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

    def _follow_ledger(self) -> None:
        """Publish every decision from now on (restored ones were published when made), and log the
        GNN's with ``learning.log_features``."""
        self.ledger.subscribe(self.decisions.placement)
        if self.features is not None:
            self.ledger.subscribe(self.features.placement)
            self.features.start()

    def _make_service(self) -> SchedulerService:
        service = SchedulerService(self.scheduler, self.lock, self.decisions.submitted)
        service.staleness_ms = self.staleness_ms
        service.refusal = self.refusal
        service.durable = self.durable
        service.limits = self.settings.limits
        service.access = self.access
        service.tenant_backlog = self.tenant_backlog
        service.take_back = self._take_back
        if self.lifecycle is not None:
            service.model_lifecycle = self.lifecycle.state
        return service

    def _take_back(self, submitted: Collection[str]) -> str | None:
        """Undo the decisions of a request whose records the bus refused (``DecisionPublisher.take_back``);
        the refusal its caller gets (UNAVAILABLE), or None when everything was published."""
        taken = self.decisions.take_back(submitted)
        return taken.refusal() if taken else None

    async def _replay_until_caught_up(self, stop: asyncio.Event, ingest: IngestThread) -> bool:
        return await wait_for_replay(
            self.replay_left, stop, ingest, self.notifier, self._monotonic, self.replay_progress
        )

    async def _journal_upkeep(self, journaled: JournaledPublisher, gate: AnswerGate) -> None:
        """Bring what ingest decided into the journal as an answer would (``gate``: written and
        fsynced by its thread, or fsynced; the API does so at once), so that the producer gets
        it; drop acknowledged records. Woken when a decision waits, else every ``JOURNAL_SYNC_S``.
        While the journal takes nothing, try it every ``JOURNAL_PROBE_S`` instead."""
        journal = journaled.journal
        wake = self._upkeep_wake or asyncio.Event()
        next_ack = self._monotonic() + JOURNAL_ACK_S
        next_hand_over = self._monotonic()
        while True:
            if not self.journal_writable:
                await asyncio.sleep(JOURNAL_PROBE_S)
                await self._journal_works_again(gate)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), JOURNAL_SYNC_S)
            wake.clear()
            if journaled.stalled is not None and self._monotonic() >= next_hand_over:
                next_hand_over = self._monotonic() + JOURNAL_PROBE_S  # the producer refused a record
                await asyncio.to_thread(journaled.hand_over)
            try:
                if journal.durable < journal.appended:
                    await gate()
                if self._monotonic() >= next_ack:
                    next_ack = self._monotonic() + JOURNAL_ACK_S
                    if len(journal):
                        await asyncio.to_thread(journaled.acknowledge, 5.0)
            except OSError as exc:  # a full disk: NOT_SERVING until it takes data again
                await self._journal_failed(exc)

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
        await asyncio.to_thread(self.stop_lifecycle)
        stop_policy(self.scheduler.policy)
        if self.shadow is not None and self.shadow.candidate is not None:
            self.shadow.candidate.stop()
        self.notifier.stopping("finishing in-flight requests")
        log.info("stopping", grace_s=self.settings.grpc.grace_s)
        await server.stop(self.settings.grpc.grace_s)  # health NOT_SERVING first, then refuse new RPCs
        self.notifier.status("storing offsets")
        if ingest.ident is not None:  # started
            await asyncio.to_thread(ingest.stop)  # the source's close() commits the stored offsets
        if self._answer_gate is not None:
            await self._settle_journal(self._answer_gate)
        self.notifier.status("writing snapshot")
        snapshot_error: BaseException | None = None
        try:
            await asyncio.to_thread(self.on_shutdown_snapshot)
        except Exception as exc:
            snapshot_error = exc
            log.exception("snapshot failed")
        if self.features is not None:  # what ingest decided last is queued: published before the exit
            await asyncio.to_thread(self.features.stop, 10.0)
        undelivered = await asyncio.to_thread(self.publisher.flush, 10.0)
        await self._cancel_background()
        if self._journaled is not None and self.journal is not None:
            if self._answer_gate is not None:
                await asyncio.to_thread(self._answer_gate.close)
            try:
                if not undelivered:  # the broker has everything: the journal may be emptied
                    await asyncio.to_thread(self._journaled.acknowledge, 1.0)
                await asyncio.to_thread(self.journal.close)
            except OSError as exc:  # the records it holds are on disk; a start reads them back
                log.error("the decision journal could not be tidied at shutdown", error=describe(exc))
                await asyncio.to_thread(self.journal.close, False)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.stop)
        if self.extender_server is not None:
            await asyncio.to_thread(self.extender_server.stop)
        applied = self._ingestor.stats.applied if self._ingestor is not None else 0
        log.info("stopped", undelivered=undelivered, applied=applied)
        if snapshot_error is not None:
            raise RuntimeError("the shutdown snapshot failed") from snapshot_error

    async def _settle_journal(self, gate: AnswerGate) -> None:
        """Ingest has stopped: commit what it decided last (the producer gets it before its final
        flush), or, when the journal takes nothing, undo it (the shutdown snapshot must not hold it)."""
        if self.journal_writable:
            try:
                await gate()
                return
            except OSError as exc:
                await self._journal_failed(exc)
        await asyncio.to_thread(self._withdraw_uncommitted)

    def _start_endpoints(self, inputs: Sequence[str]) -> MetricsServer | None:
        """The HTTP endpoints beside gRPC: ``/metrics`` (returned) and the scheduler extender."""
        self.extender_server = self._start_extender()
        return self._start_metrics(inputs)

    def _start_extender(self) -> ExtenderServer | None:
        """The Kubernetes scheduler extender on ``extender.listen`` (None: off), answered by this
        daemon's scheduler under its lock."""
        settings = self.settings.extender
        if not settings.listen:
            return None
        extender = Extender(self.scheduler, self.lock, self.refusal, settings.device_resources)
        server = ExtenderServer(extender, settings.listen)
        log.info("scheduler extender serving", listen=settings.listen, port=server.port)
        return server

    def _start_metrics(self, inputs: Sequence[str]) -> MetricsServer | None:
        self.metrics.observe(self.metrics_sample)
        metrics_server = start_metrics_server(self.metrics.registry, self.settings.metrics.listen)
        if metrics_server is None:
            return None
        self.metrics_port = metrics_server.port
        probe = lag_probe(self.bus, self.settings, inputs)
        if probe is not None:
            self._spawn(watch_lag(probe, self.settings.metrics.lag_interval_s, self._record_lag))
        return metrics_server

    def _record_lag(self, lag: Lag) -> None:
        self._lag = lag

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_background(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _status_line(self) -> str:
        return f"serving on {self.settings.grpc.listen}, ledger at sequence {self.ledger.last_sequence}"

    # -- reload (hlb.daemon.runtime.reload) --------------------------------------------------

    def request_reload(self) -> None:
        """Schedule a reload on the running loop (the SIGHUP handler)."""
        self._spawn(self.reload())

    async def reload(self) -> ReloadResult:
        """Re-read the config file and apply what can change while running (``reloaders``)."""
        async with self._reload_lock:
            self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
            try:
                return await self._reload(reload_settings(self.config_path, self.settings, self._reloader_for))
            finally:
                self.notifier.ready(self._status_line())

    async def reload_to(self, new: Settings) -> ReloadResult:
        """Apply what can change while running of settings loaded elsewhere (a shard: its
        instance's file, with the shard's own state directory)."""
        async with self._reload_lock:
            return await self._reload(apply_settings(new, self.settings, self._reloader_for))

    def _reloader_for(self, key: str) -> Reloader | None:
        return reloader_for(self.reloaders, self.restart_only, key)

    async def _reload(self, applying: Awaitable[tuple[Settings, ReloadResult]]) -> ReloadResult:
        self.settings, result = await applying
        reloaded = (*result.applied, *result.failed)
        if result.error is None and not any(key.startswith("auth.") for key in reloaded):
            result = await asyncio.to_thread(self._reread_policy, result)
        self.metrics.reloads.labels(result=result.outcome).inc()
        policy = self.scheduler.policy
        if has_model(policy):  # SIGHUP also looks at the model files again
            await asyncio.to_thread(reload_model_files, policy)
        return result

    def _reread_policy(self, result: ReloadResult) -> ReloadResult:
        """The policy file's contents may have changed with no key: read it again, keeping the
        running policy (and saying so in ``result``) when it does not load."""
        try:
            self.access.reload(self.settings)
        except ConfigError as exc:
            log.error("reload of the access policy refused; the running policy is kept", error=str(exc))
            return dataclasses.replace(result, failed=(*result.failed, "auth.policy_file"))
        return result

    def _start_policy(self) -> None:
        """Load and warm up a GNN's model on the current graph and start its refresh thread (and
        the shadow candidate's, which a model that does not load leaves degraded, logged), then the model
        lifecycle's thread (``learning.auto_models``)."""
        start_policy(self.scheduler.policy, self.scheduler.graph, self.lock)
        if self.shadow is not None and self.shadow.candidate is not None:
            self.shadow.candidate.start(self.scheduler.graph, self.lock)
        self._start_lifecycle()  # after the running model: a promoted version replaces it
