"""Decision features on Kafka: what the GNN read and predicted for each of its decisions.

With ``learning.log_features`` on, :class:`FeatureLog` listens to the placement ledger (as the
publisher of the ledger topic does) and writes the placements the GNN policy decided to
``learning.topic``, many to a record (``hlb.v1.DecisionFeaturesBatch``, column by column), keyed
by the cell as the ledger is. Per decision: the task's shape and the speed head's task input, the
devices the model predicts fastest for that shape (``learning.top_k``, of every device it has an
embedding of) and the chosen ones, each with the head's prior features (the log of the profiles'
speed first), the predicted log speed ratio and log standard deviation, where a chosen device
sits (its host, rack and load), the model and feature schema versions, and the propensity of the
choice (1: the daemon does not explore). What a shape shares is written once per record, with
the encoder's context vector; per decision, the embedding of its label's device (the chosen one
with the lowest prior log speed), in float16: with those, a record holds every input the speed
head read for the label, and a learner can refit the head without the graph. ``hlb features
tail`` unfolds a record into one ``hlb.v1.DecisionFeatures`` per decision.

Off the request path. The listener runs inside the decision, under the daemon's lock: it reads
what the scorer kept of the shape (once per shape and embedding refresh: array references and the
fastest devices) and the chosen devices' few fields, and appends them to columns
(:class:`~hlb.daemon.record.feature_record.Decisions`): references and numbers, no object per
decision, never waiting. A thread takes the columns once no decision holds the daemon's lock,
builds records of up to ``RECORD_DECISIONS`` decisions with numpy
(:mod:`hlb.daemon.record.feature_record`) and publishes them; a full queue drops the decision and
counts it, a record the bus refuses is counted too (each of its decisions).

A record may outlive its decision: a placement the ledger topic refused is undone
(``DecisionPublisher.take_back``) after it was queued. Readers join decisions with the ledger
(``hlb features tail``), so such a decision joins nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import structlog

from hlb.daemon.bus.kafkalog import FoldedLog
from hlb.daemon.bus.seam import Publisher
from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.scorer import EmbeddingCache, GnnScorer, ShapeKey, shape_key
from hlb.daemon.decide.presets import gnn_scorer
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.record.feature_record import (
    Decisions,
    DeviceSite,
    ShapeEntry,
    build_batch,
    device_site,
    embedding_position,
    fastest,
)
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

# What a record's fate is counted as (hlb_feature_records_total's outcome label).
OUTCOMES = ("published", "dropped", "skipped", "failed")
# (outcome, bytes: the record's size when published, else 0, decisions: how many it counts)
Outcome = Callable[[str, int, int], None]


class FeatureLog:
    """The ledger listener that logs the GNN's decisions (module docstring).

    ``publisher``: where records go (the daemon gives it a producer of its own, so that the ledger
    never queues behind features); ``on_outcome``: counts each record's fate (:data:`OUTCOMES`)
    and its bytes. :meth:`start` the thread, :meth:`stop` it (publishing what is queued first).

    The queue is columns (:class:`Decisions`) that a decision appends to (never waiting, never
    waking anything) and the thread takes from, looking every ``POLL_S`` while fewer than
    ``BATCH`` wait (unless the oldest has waited ``BATCH_WAIT_S``). Building a record is Python
    work, which holds the interpreter's lock as a decision does: given ``lock`` (the daemon's,
    held by requests and ingest while they decide), the thread waits on it and builds only while no
    decision runs, one record at a time, unless the oldest decision has waited ``patience_s``
    (under a load that never pauses, records then go out interleaved with decisions). Waiting on
    the lock rather than polling it leaves the interpreter to the decisions until they are done."""

    POLL_S = 0.01
    BATCH = 64
    BATCH_WAIT_S = 0.1
    IDLE_WAIT_S = 0.1  # the longest one wait on the daemon's lock (then stopping is looked at)
    RECORD_DECISIONS = 512  # at most in one record (bounds its bytes: about 200 B a decision of one device)

    def __init__(
        self,
        scheduler: Scheduler,
        publisher: Publisher,
        topic: str,
        *,
        top_k: int = 8,
        queue_size: int = 10_000,
        on_outcome: Outcome | None = None,
        lock: threading.RLock | None = None,
        max_record_bytes: int = 1_048_576,
        patience_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.lock = lock
        self.max_record_bytes = max_record_bytes  # a record's value at most (kafka.max_event_bytes)
        self.patience_s = patience_s
        self.publisher = publisher
        self.topic = topic
        self.top_k = top_k
        self.queue_size = queue_size
        self.enabled = True  # off: decisions are not looked at (``hlb bench features`` toggles it)
        self.on_outcome: Outcome = on_outcome or (lambda outcome, size, decisions: None)
        self._queue = Decisions()
        self._queued = 0  # appended, ever (by decisions, which hold the daemon's lock)
        self._taken = 0  # taken from the queue, ever (by the thread)
        self._handled = 0  # published or failed, ever (by the thread)
        self._monotonic = monotonic
        # Lock side, of one cache and inventory (``_read_of``): each shape's entry, each row's
        # position in the embeddings; of one inventory, each row's site.
        self._shapes: dict[ShapeKey, ShapeEntry] = {}
        self._positions: dict[int, int] = {}
        self._sites: dict[int, DeviceSite] = {}
        self._read_of: tuple[EmbeddingCache | None, int] = (None, -1)
        self._policy: Policy | None = None
        self._scorer: GnnScorer | None = None
        self._stop = threading.Event()
        self._handed = threading.Condition()  # _handled grew
        self._thread: threading.Thread | None = None
        self.published = 0  # decisions
        self.published_bytes = 0
        self.records = 0
        self.build_s = 0.0  # thread time building and handing over records (hlb bench features reports it)
        self._log_failure = FoldedLog("decision features not published; counted, the decision stands", logger=log)

    # -- inside the decision (under the daemon's lock) ------------------------------------------

    def placement(self, placement: ev.Placement) -> None:
        """The ledger recorded ``placement``: capture what the GNN read for it and queue it."""
        if not self.enabled:
            return
        policy = self.scheduler.policy
        if policy is not self._policy:  # a reload swapped it
            self._policy, self._scorer = policy, gnn_scorer(policy)
        scorer, graph = self._scorer, self.scheduler.graph
        task = graph.tasks.get(placement.task_id)
        if scorer is None or task is None or not task.device_rows or placement.policy != "gnn":
            self.on_outcome("skipped", 0, 1)
            return
        if self._queued - self._taken >= self.queue_size:
            self.on_outcome("dropped", 0, 1)
            return
        spec, rows = task.spec, task.device_rows
        entry = self._shape_entry(scorer, spec, rows)
        if entry is None:
            self.on_outcome("skipped", 0, 1)
            return
        queue, sites, positions, memory_gb = self._queue, self._sites, self._positions, spec.memory_per_device_gb
        for r in rows:
            site = sites.get(r)
            if site is None:
                site = sites[r] = device_site(graph, r)
            position = positions.get(r)
            if position is None:
                position = positions[r] = embedding_position(graph, entry.cache, r)
            prior = None
            if position < 0:  # a device newer than the embeddings: its prior features now
                rows_of = np.array([r], dtype=np.int64)
                prior = feat.prior_features(
                    spec, graph, rows_of, scorer.fallback.profiles, entry.gang, entry.consolidated
                )[0]
            queue.add_device(graph, r, site, position, memory_gb, prior)
        queue.add(placement, spec, entry, self._monotonic())
        self._queued += 1

    def _shape_entry(self, scorer: GnnScorer, spec: ev.TaskSpec, rows: tuple[int, ...]) -> ShapeEntry | None:
        """What the scorer kept of the decision's shape (read once per shape and cache)."""
        graph, cache = self.scheduler.graph, scorer.cache
        if cache is None:
            return None
        if cache is not self._read_of[0] or graph.version != self._read_of[1]:
            if graph.version != self._read_of[1]:
                self._sites = {}
            self._shapes, self._positions, self._read_of = {}, {}, (cache, graph.version)
        gang = len(rows)
        consolidated = gang == 1 or len({int(graph.devices.host[r]) for r in rows}) == 1
        key = shape_key(spec, gang, consolidated)
        entry = self._shapes.get(key)
        if entry is not None:
            return entry
        inputs = scorer.shape_inputs(spec, gang, consolidated)
        if inputs is None and not consolidated:
            # A gang spread over hosts the policy scored as one on a host: log what it read (the
            # record's shape says so; hlb features tail does not label such a row).
            consolidated = True
            inputs = scorer.shape_inputs(spec, gang, consolidated)
        if inputs is None or inputs[0] is not cache:
            return None
        top = fastest(cache, graph, inputs[1], inputs[2], self.top_k)
        entry = self._shapes[key] = ShapeEntry(spec, gang, consolidated, cache, inputs[1], inputs[2], top)
        return entry

    # -- the log's thread -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="feature-log", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> int:
        """Publish what is queued, stop the thread and flush the publisher; returns the records the
        publisher still held undelivered after ``timeout_s``."""
        if self._thread is not None:
            self._stop.set()  # the thread empties the queue first
            self._thread.join(timeout_s)
            self._thread = None
        return self.publisher.flush(timeout_s)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued record has been handled (published, or counted failed); False
        when ``timeout_s`` passed first."""
        with self._handed:  # told by the thread (no polling: it would take the interpreter from the builder)
            return self._handed.wait_for(lambda: self._handled >= self._queued, timeout_s)

    def _run(self) -> None:
        draining = False  # building until the queue is empty
        while True:
            stopping = self._stop.is_set()
            waiting = self._queued - self._taken
            if not waiting:
                if stopping:
                    return
                draining = False
                self._stop.wait(self.POLL_S)
                continue
            draining = draining or stopping or waiting >= self.BATCH or self._waited() >= self.BATCH_WAIT_S
            if not draining:
                self._stop.wait(self.POLL_S)
            elif stopping or self._idle():
                n = min(waiting, self.RECORD_DECISIONS)
                taken = self._queue.take(n)
                self._taken += n
                self._publish(taken)
                with self._handed:
                    self._handled += n
                    self._handed.notify_all()

    def _idle(self) -> bool:
        """Whether the thread may build now: once no decision runs (waiting on the daemon's lock at
        most ``IDLE_WAIT_S``), or when the oldest decision has waited ``patience_s``."""
        left = self.patience_s - self._waited()
        if self.lock is None or left <= 0:
            return True
        if self.lock.acquire(timeout=min(left, self.IDLE_WAIT_S)):
            self.lock.release()
            return True
        return False

    def _waited(self) -> float:
        """How long the oldest queued decision has waited."""
        return self._monotonic() - self._queue.queued_s[0]

    def _publish(self, taken: Decisions) -> None:
        """One record per cell of ``taken`` (in ledger order within each)."""
        cells = [p.cell for p in taken.placements]
        if cells.count(cells[0]) == len(cells):
            self._publish_cell(cells[0], taken)
            return
        by_cell: dict[str, list[int]] = {}
        for i, cell in enumerate(cells):
            by_cell.setdefault(cell, []).append(i)
        for cell, indices in by_cell.items():
            self._publish_cell(cell, taken.select(indices))

    def _publish_cell(self, cell: str, decisions: Decisions) -> None:
        start, n = time.perf_counter(), len(decisions.placements)
        value: bytes | None = None
        try:
            value = build_batch(cell, decisions)
            if len(value) <= self.max_record_bytes or n == 1:
                self.publisher.publish(self.topic, cell.encode(), value)
        except Exception as exc:  # a bus that refuses, a record that cannot be built: counted, never fatal
            self.on_outcome("failed", 0, n)
            self._log_failure(type(exc).__name__, task_id=decisions.placements[0].task_id, decisions=n, error=str(exc))
            return
        finally:
            self.build_s += time.perf_counter() - start
        if len(value) > self.max_record_bytes and n > 1:  # in halves, each within the bound
            for half in (range(n // 2), range(n // 2, n)):
                self._publish_cell(cell, decisions.select(list(half)))
            return
        self.published += n
        self.published_bytes += len(value)
        self.records += 1
        self.on_outcome("published", len(value), n)


__all__ = ["OUTCOMES", "FeatureLog"]
