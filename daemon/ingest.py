"""Ingest: records off the bus, decoded, validated and applied to the scheduler, batch by batch.

Each record goes through a short pipeline (decode → apply, where applying validates first and
changes nothing when it refuses). A record that fails goes to the dead-letter topic with headers
naming where it came from and why; the batch goes on. The source's position is stored only after
the whole batch has been applied, which makes delivery at-least-once; applying is idempotent, so
a replayed record changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import structlog

from daemon.bus import EventSource, Publisher, RawEvent
from daemon.codec import decode
from daemon.config import Topics
from daemon.errors import EventError
from daemon.scheduler import Scheduler
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

Apply = Callable[[RawEvent], None]


@dataclass
class IngestStats:
    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    batches: int = 0


class Ingestor:
    """Applies batches from ``source`` to ``scheduler`` under ``lock``; bad records go to ``dlq_topic``."""

    def __init__(
        self,
        source: EventSource,
        publisher: Publisher,
        scheduler: Scheduler,
        lock: AbstractContextManager[object],
        topics: Topics,
        max_event_bytes: int,
    ) -> None:
        self.source = source
        self.publisher = publisher
        self.scheduler = scheduler
        self.lock = lock
        self.dlq_topic = topics.dlq
        self.stats = IngestStats()
        self._pipelines: dict[str, Apply] = {
            topics.telemetry: lambda r: scheduler.apply_telemetry(decode(r.value, ev.TelemetryEvent, max_event_bytes)),
            topics.tasks: lambda r: scheduler.apply_task_event(decode(r.value, ev.TaskEvent, max_event_bytes)),
        }

    def run_once(self, max_events: int, timeout_s: float) -> int:
        """Consume, apply and commit one batch; returns the number of records in it."""
        batch = self.source.next_batch(max_events, timeout_s)
        if not batch:
            return 0
        with self.lock:
            for record in batch:
                self._apply(record)
            placed = self.scheduler.schedule_pending()
        self.source.commit(batch)
        self.stats.batches += 1
        if placed:
            log.info("placed", count=len(placed), sequence=placed[-1].sequence)
        return len(batch)

    def _apply(self, record: RawEvent) -> None:
        try:
            self._pipelines[record.topic](record)
        except EventError as exc:
            self.stats.rejected[exc.reason] += 1
            self._dead_letter(record, exc.reason, str(exc))
        else:
            self.stats.applied += 1

    def _dead_letter(self, record: RawEvent, reason: str, message: str) -> None:
        log.warning(
            "event rejected",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
            error=message,
        )
        headers = [
            ("hlb.source.topic", record.topic.encode()),
            ("hlb.source.partition", str(record.partition).encode()),
            ("hlb.source.offset", str(record.offset).encode()),
            ("hlb.error.reason", reason.encode()),
            ("hlb.error.message", message.encode("utf-8", "replace")),
        ]
        self.publisher.publish(self.dlq_topic, record.key, record.value or b"", headers)


class IngestThread(threading.Thread):
    """Runs an ``Ingestor`` until stopped; the only thread that touches the consumer."""

    def __init__(self, ingestor: Ingestor, batch_size: int, poll_timeout_s: float) -> None:
        super().__init__(name="hlb-ingest", daemon=True)
        self.ingestor = ingestor
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self._stop_requested = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._stop_requested.is_set():
                self.ingestor.run_once(self.batch_size, self.poll_timeout_s)
        except BaseException as exc:  # surfaced to the service, which stops with an error
            self.failure = exc
            log.exception("ingest stopped")
        finally:
            self.ingestor.source.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_requested.set()
        deadline = time.monotonic() + timeout_s
        self.join(max(0.0, deadline - time.monotonic()))


def drain(ingestor: Ingestor, batch_size: int = 1000, idle_batches: int = 1) -> int:
    """Apply everything available now (for tests and tools); returns the number of records seen."""
    seen = 0
    idle = 0
    while idle < idle_batches:
        count = ingestor.run_once(batch_size, 0.0)
        seen += count
        idle = idle + 1 if count == 0 else 0
    return seen
