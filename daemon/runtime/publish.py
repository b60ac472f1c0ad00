"""What the daemon writes to the bus: its decisions (``DecisionPublisher``) and, on the ingest path,
everything else with the dead letters counted (``CountingPublisher``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import structlog
from prometheus_client import Counter

from hlb.daemon.bus.kafkalog import FoldedLog
from hlb.daemon.bus.seam import Publisher
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.runtime.durability import describe
from hlb.daemon.runtime.metrics import DaemonMetrics
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

UNPUBLISHED_REASON = "queued again: its placement could not be published to the ledger topic"


@dataclass
class TakenBack:
    """What ``DecisionPublisher.take_back`` undid because the bus refused its records (task ids,
    in the order they were decided), and the first refusal in words."""

    placements: list[str] = field(default_factory=list)  # placements undone: the task is queued again
    submissions: list[str] = field(default_factory=list)  # tasks submitted by the request, dropped
    error: str = ""

    def __bool__(self) -> bool:
        return bool(self.placements or self.submissions)

    def refusal(self) -> str:
        """The answer to the request whose decisions these were (gRPC ``UNAVAILABLE``)."""
        tasks = list(dict.fromkeys([*self.placements, *self.submissions]))
        shown = ", ".join(repr(t) for t in tasks[:5]) + (f" and {len(tasks) - 5} more" if len(tasks) > 5 else "")
        return (
            f"the placement could not be published to the ledger topic ({self.error}): it was not recorded "
            f"and nothing was decided for task {shown}; the request may be retried"
        )


class DecisionPublisher:
    """What the daemon publishes as its own decisions: each placement the ledger records (topic
    ``placements``, counted by policy in ``hlb_placements``) and each task submitted through the
    API (topic ``tasks``, a ``submitted`` event of the scheduler's cell). ``publisher`` is replaced
    when the journal opens (``Daemon.open_journal``) or a shard's transactions start.
    ``hlb bench latency --journal`` publishes through this class too.

    A record ``publisher`` refuses (it raises: librdkafka refusing a record at once, a producer
    in a fatal state) does not escape into the scheduler, which calls ``placement`` from inside a
    decision: it is noted, logged (folded) and counted in ``hlb_decisions_unpublished_total``, and
    whoever decided, still holding the daemon's lock, calls ``take_back`` to undo what was not
    recorded. (Through the journal nothing is refused here: the producer gets the records once the
    journal holds them, ``JournaledPublisher``.)"""

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
        self.unpublished: Counter | None = None  # hlb_decisions_unpublished_total, by kind, where wired
        # Records the publisher refused since the last take_back: placements, and submitted task ids.
        self._refused_placements: list[ev.Placement] = []
        self._refused_submissions: list[str] = []
        self._error = ""
        self._log_refusal = FoldedLog("decision not published: the bus refused it; undone", logger=log)

    def placement(self, placement: ev.Placement) -> None:
        try:
            self.publisher.publish(self._topics.placements, placement.cell.encode(), placement.SerializeToString())
        except Exception as exc:  # the scheduler is mid-decision: undone by take_back, under the same lock
            self._refused("placement", exc, placement.task_id)
            self._refused_placements.append(placement)
            return
        counter = self._placements_of.get(placement.policy)
        if counter is None:
            counter = self._placements_of[placement.policy] = self._placements.labels(policy=placement.policy)
        counter.inc()

    def submitted(self, spec: ev.TaskSpec) -> None:
        if self._refused_placements and any(p.task_id == spec.id for p in self._refused_placements):
            return  # its placement was not recorded: take_back drops the task, which must not come back
        cell = self._scheduler.cell
        event = ev.TaskEvent(cell=cell, event_time_ms=int(self._clock() * 1000), submitted=spec)
        try:
            self.publisher.publish(self._topics.tasks, cell.encode(), event.SerializeToString())
        except Exception as exc:
            self._refused("submission", exc, spec.id)
            self._refused_submissions.append(spec.id)

    def lost(self, event: ev.TaskEvent) -> None:
        """A placement the scheduler took back (its lease expired), as a ``lost`` event on the tasks
        topic: read back it changes nothing, replayed after a restart it takes the placement back
        again. One the bus refuses is logged and counted; the lease then expires again after a
        restart."""
        try:
            self.publisher.publish(self._topics.tasks, event.cell.encode(), event.SerializeToString())
        except Exception as exc:
            if self.unpublished is not None:
                self.unpublished.labels(kind="lost").inc()
            self._log_refusal("lost", task_id=event.lost.task_id, error=describe(exc))

    def take_back(self, submitted: Collection[str] = ()) -> TakenBack:
        """Undo the decisions whose records the publisher refused since the last call; the caller
        holds the daemon's lock and calls it after every decision it made (nothing refused: a
        no-op). ``submitted``: the tasks the caller's request submitted, which go altogether when
        their placement or submission was not recorded; any other task whose placement was not is
        queued again (decided afresh at the next pass)."""
        if not self._refused_placements and not self._refused_submissions:
            return TakenBack()
        placements, self._refused_placements = self._refused_placements, []
        dropped, self._refused_submissions = self._refused_submissions, []
        done = TakenBack(error=self._error)
        scheduler = self._scheduler
        for placement in reversed(placements):
            if scheduler.unplace(placement, UNPUBLISHED_REASON):
                done.placements.append(placement.task_id)
        gone = {p.task_id for p in placements if p.task_id in submitted}.union(dropped)
        for task_id in gone:
            placed = scheduler.ledger.get(task_id)  # its placement was published, its submission not
            if placed is not None and scheduler.unplace(placed, UNPUBLISHED_REASON):
                done.placements.append(task_id)
            if scheduler.withdraw_submission(task_id):
                done.submissions.append(task_id)
        done.placements.reverse()
        return done

    def _refused(self, kind: str, exc: Exception, task_id: str) -> None:
        if not self._refused_placements and not self._refused_submissions:
            self._error = describe(exc)
        if self.unpublished is not None:
            self.unpublished.labels(kind=kind).inc()
        self._log_refusal(kind, task_id=task_id, error=describe(exc))


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
