"""What the daemon writes to the bus: its decisions (``DecisionPublisher``) and, on the ingest path,
everything else with the dead letters counted (``CountingPublisher``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import Counter

from hlb.daemon.bus.seam import Publisher
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.runtime.metrics import DaemonMetrics
from hlb.v1 import events_pb2 as ev


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
