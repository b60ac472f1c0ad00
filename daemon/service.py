"""``hlb serve``: the daemon, wired from its parts.

Start-up order: restore the placement ledger from its topic, start ingest on its own thread,
start the gRPC server, then report SERVING. Shutdown (SIGTERM, SIGINT) runs the other way: stop
taking requests, let in-flight RPCs finish within the grace period, stop ingest (which stores
and commits offsets), and flush what is still queued for the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from pathlib import Path

import structlog

from daemon.api import GrpcServer, SchedulerService
from daemon.bus import EventBus, MemoryBus
from daemon.codec import decode
from daemon.config import EX_CONFIG, Settings, default_config_path, load_settings
from daemon.errors import BrokerError, ConfigError, EventError
from daemon.graph import InfraGraph
from daemon.ingest import Ingestor, IngestThread
from daemon.ledger import PlacementLedger
from daemon.logs import configure_logging
from daemon.policy import make_policy
from daemon.scheduler import Clock, Scheduler
from daemon.sdnotify import SystemdNotifier, WatchdogPinger
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)


def make_bus(settings: Settings) -> EventBus:
    if settings.bus == "memory":
        return MemoryBus()
    from daemon.kafka_bus import KafkaBus  # librdkafka loads only when Kafka is used

    return KafkaBus(settings.kafka)


class Daemon:
    """One hlb instance: graph, scheduler, ingest thread and gRPC server around one lock."""

    def __init__(self, settings: Settings, bus: EventBus, clock: Clock = time.time) -> None:
        self.settings = settings
        self.bus = bus
        self.clock = clock
        self.lock = threading.RLock()
        self.ledger = PlacementLedger()
        self.scheduler = Scheduler(
            InfraGraph(), make_policy(settings.scheduler.policy), self.ledger, settings.cell, clock
        )
        self.publisher = bus.publisher()
        self.ready = asyncio.Event()
        self.port = 0
        self.notifier = SystemdNotifier()

    def _publish_placement(self, placement: ev.Placement) -> None:
        self.publisher.publish(
            self.settings.kafka.topics.placements, placement.cell.encode(), placement.SerializeToString()
        )

    def _publish_submitted(self, spec: ev.TaskSpec) -> None:
        event = ev.TaskEvent(cell=self.settings.cell, event_time_ms=int(self.clock() * 1000), submitted=spec)
        self.publisher.publish(self.settings.kafka.topics.tasks, self.settings.cell.encode(), event.SerializeToString())

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

    def staleness_ms(self) -> float:
        newest = self.scheduler.graph.newest_telemetry_ms
        return -1.0 if newest == 0 else max(0.0, self.clock() * 1000 - newest)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; raises if ingest fails."""
        topics = self.settings.kafka.topics
        await asyncio.to_thread(
            self.bus.ensure_topics, [topics.telemetry, topics.tasks, topics.placements, topics.dlq], [topics.inventory]
        )
        restored = await asyncio.to_thread(self.restore_ledger)
        log.info("ledger restored", placements=restored, last_sequence=self.ledger.last_sequence)
        self.ledger.subscribe(self._publish_placement)

        source = self.bus.source([topics.telemetry, topics.tasks], self.settings.kafka.group_id)
        ingestor = Ingestor(
            source, self.publisher, self.scheduler, self.lock, topics, self.settings.kafka.max_event_bytes
        )
        self.ingest = IngestThread(ingestor, self.settings.kafka.batch_size, self.settings.kafka.poll_timeout_s)
        service = SchedulerService(self.scheduler, self.lock, self._publish_submitted)
        service.staleness_ms = self.staleness_ms
        grpc_settings = self.settings.grpc
        server = GrpcServer(service, grpc_settings.listen, grpc_settings.max_message_bytes, grpc_settings.reflection)
        self.port = server.port
        await server.start()
        self.ingest.start()
        await server.set_serving()
        self.ready.set()
        log.info("serving", listen=grpc_settings.listen, port=server.port, bus=self.settings.bus)
        self.notifier.ready(f"serving on {grpc_settings.listen}, ledger at sequence {self.ledger.last_sequence}")
        pinger = WatchdogPinger(self.notifier)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stopped.done() and self.ingest.is_alive():
                # The watchdog is fed from this loop, so a stuck event loop stops the pings.
                pinger.tick(time.monotonic())
                await asyncio.wait([stopped], timeout=min(1.0, pinger.interval_s or 1.0))
        finally:
            stopped.cancel()
            self.notifier.stopping("finishing in-flight requests")
            log.info("stopping")
            await server.stop(grpc_settings.grace_s)
            await asyncio.to_thread(self.ingest.stop)
            undelivered = await asyncio.to_thread(self.publisher.flush, 10.0)
            log.info("stopped", undelivered=undelivered, applied=ingestor.stats.applied)
        if self.ingest.failure is not None:
            raise RuntimeError("ingest failed") from self.ingest.failure


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
    return asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # Without a handler SIGHUP (systemctl reload) would end the process.
    loop.add_signal_handler(signal.SIGHUP, lambda: log.warning("reload is not supported yet; restart to apply"))
    daemon = Daemon(settings, make_bus(settings))
    try:
        await daemon.run(stop)
    except BrokerError as exc:
        log.error("daemon failed", error=str(exc))
        return 1
    except Exception:
        log.exception("daemon failed")
        return 1
    return 0
