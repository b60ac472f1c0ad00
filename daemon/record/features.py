"""Decision features on Kafka: what the GNN read and predicted for each of its decisions.

With ``learning.log_features`` on, :class:`FeatureLog` listens to the placement ledger (as the
publisher of the ledger topic does) and writes, for each placement the GNN policy decided, one
``hlb.v1.DecisionFeatures`` to ``learning.topic``, keyed by the cell as the ledger is: the task's
shape and the speed head's task input, the devices the model predicts fastest for that shape
(``learning.top_k``, of every device it has an embedding of) and the chosen ones, each with the
head's prior features (the log of the profiles' speed first), the predicted log speed ratio and
log standard deviation, where a chosen device sits (its host, rack and load), the model and feature
schema versions, and the propensity of the choice (1: the daemon does not explore). The device
embeddings are not logged: 32 floats a device, and a learner re-encodes the graph anyway.

Off the request path. The listener runs inside the decision, under the daemon's lock: it reads
what the scorer kept of the shape (:meth:`GnnScorer.shape_inputs`, array references), the
chosen devices' few fields, and the fastest devices of the shape (once per shape and embedding
refresh), then hands them to a bounded queue without waiting. A thread builds each record
(:mod:`hlb.daemon.record.feature_record`) and publishes it; a full queue drops the record and counts
it, a record the bus refuses is counted too. Nothing here can fail or slow a decision beyond those
reads, and the thread builds while no decision runs (:class:`FeatureLog`).

A record may outlive its decision: a placement the ledger topic refused is undone
(``DecisionPublisher.take_back``) after its record was queued. Readers join records with the
ledger (``hlb features tail``), so such a record joins nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import structlog

from hlb.daemon.bus.kafkalog import FoldedLog
from hlb.daemon.bus.seam import Publisher
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.scorer import GnnScorer, ShapeKey, shape_key
from hlb.daemon.decide.presets import gnn_scorer
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.record.feature_record import (
    Captured,
    DeviceSite,
    FastestDevices,
    ShapeRecordParts,
    build_record,
    chosen_device,
    device_site,
    fastest,
    shape_parts,
)
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

# What a record's fate is counted as (hlb_feature_records_total's outcome label).
OUTCOMES = ("published", "dropped", "skipped", "failed")
Outcome = Callable[[str, int], None]  # (outcome, bytes: the record's size when published, else 0)


def lock_busy(lock: threading.RLock) -> Callable[[], bool]:
    """Whether another thread holds ``lock`` now (a probe: taken and released at once when free)."""

    def busy() -> bool:
        if lock.acquire(blocking=False):
            lock.release()
            return False
        return True

    return busy


class FeatureLog:
    """The ledger listener that logs the GNN's decisions (module docstring).

    ``publisher``: where records go (the daemon gives it a producer of its own, so that the ledger
    never queues behind features); ``on_outcome``: counts each record's fate (:data:`OUTCOMES`)
    and its bytes. :meth:`start` the thread, :meth:`stop` it (publishing what is queued first).

    The queue is a deque that the decision appends to (never waiting, never waking anything: an
    append and a length check) and the thread empties, looking every ``POLL_S`` while it is empty.
    Building a record is Python work, which holds the interpreter's lock as a decision does: with
    ``busy`` (the daemon's: whether a request or ingest holds the daemon's lock, :func:`lock_busy`),
    the thread builds only while no decision runs, unless the oldest record has waited
    ``patience_s`` (under a load that never pauses, records then go out interleaved with decisions)."""

    # Each wake takes the interpreter's lock from whatever runs: seldom, and then for many records
    # (``BATCH`` at least, unless the oldest has waited ``BATCH_WAIT_S``), each when no decision runs.
    POLL_S = 0.01
    BATCH = 64
    BATCH_WAIT_S = 0.1

    def __init__(
        self,
        scheduler: Scheduler,
        publisher: Publisher,
        topic: str,
        *,
        top_k: int = 8,
        queue_size: int = 10_000,
        on_outcome: Outcome | None = None,
        busy: Callable[[], bool] | None = None,
        patience_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.busy = busy or (lambda: False)
        self.patience_s = patience_s
        self.publisher = publisher
        self.topic = topic
        self.top_k = top_k
        self.queue_size = queue_size
        self.enabled = True  # off: decisions are not looked at (``hlb bench features`` toggles it)
        self.on_outcome: Outcome = on_outcome or (lambda outcome, size: None)
        self._queue: deque[Captured] = deque()
        self._queued = 0  # appended, ever (by decisions, which hold the daemon's lock)
        self._handled = 0  # published or failed, ever (by the thread)
        self._monotonic = monotonic
        # Lock side, of one cache and inventory (``_read_of``): each shape's fastest devices, each row's site.
        self._fastest: dict[ShapeKey, FastestDevices] = {}
        self._sites: dict[int, DeviceSite] = {}
        self._read_of = (-1, -1)
        self._parts: dict[ShapeKey, ShapeRecordParts] = {}  # of the cache ``_parts_of`` (thread side)
        self._parts_of = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        self.published_bytes = 0
        self.build_s = 0.0  # thread time building and handing over records (hlb bench features reports it)
        self._log_failure = FoldedLog("decision features not published; counted, the decision stands", logger=log)

    # -- inside the decision (under the daemon's lock) ------------------------------------------

    def placement(self, placement: ev.Placement) -> None:
        """The ledger recorded ``placement``: capture what the GNN read for it and queue it."""
        if not self.enabled:
            return
        scorer = gnn_scorer(self.scheduler.policy)
        task = self.scheduler.graph.tasks.get(placement.task_id)
        if scorer is None or task is None or not task.device_rows or placement.policy != "gnn":
            self.on_outcome("skipped", 0)
            return
        if len(self._queue) >= self.queue_size:
            self.on_outcome("dropped", 0)
            return
        captured = self._capture(scorer, placement, task.spec, task.device_rows)
        if captured is None:
            self.on_outcome("skipped", 0)
            return
        self._queue.append(captured)
        self._queued += 1

    def _capture(
        self, scorer: GnnScorer, placement: ev.Placement, spec: ev.TaskSpec, rows: tuple[int, ...]
    ) -> Captured | None:
        graph = self.scheduler.graph
        gang = len(rows)
        consolidated = gang == 1 or len({int(graph.devices.host[r]) for r in rows}) == 1
        inputs = scorer.shape_inputs(spec, gang, consolidated)
        if inputs is None and not consolidated:
            # A gang spread over hosts the policy scored as one on a host: log what it read (the
            # record's shape says so; hlb features tail does not label such a row).
            consolidated = True
            inputs = scorer.shape_inputs(spec, gang, consolidated)
        if inputs is None:
            return None
        cache, predictions, priors = inputs
        if (cache.serial, graph.version) != self._read_of:
            self._fastest, self._sites, self._read_of = {}, {}, (cache.serial, graph.version)
        key = shape_key(spec, gang, consolidated)
        top = self._fastest.get(key)
        if top is None:
            top = self._fastest[key] = fastest(cache, graph, predictions, priors, self.top_k)
        memory_gb, sites = spec.memory_per_device_gb, self._sites
        chosen = []
        for r in rows:
            site = sites.get(r)
            if site is None:
                site = sites[r] = device_site(graph, cache, r)
            chosen.append(chosen_device(graph, site, r, memory_gb))
        for g, device in enumerate(chosen):
            if device.site.position < 0:  # a device newer than the embeddings: its prior features now
                prior = feat.prior_features(
                    spec, graph, np.array([rows[g]], dtype=np.int64), scorer.fallback.profiles, gang, consolidated
                )
                chosen[g] = device._replace(prior=prior[0])
        now = self._monotonic()
        age_ms = max(0, int((now - cache.built_at) * 1000))
        return Captured(
            placement, spec, key, gang, consolidated, cache, predictions, priors, top, tuple(chosen), age_ms, now
        )

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
        deadline = self._monotonic() + timeout_s
        while self._handled < self._queued:
            if self._monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def _run(self) -> None:
        queue, busy, patience_s = self._queue, self.busy, self.patience_s
        while True:
            stopping = self._stop.is_set()
            if queue and (stopping or len(queue) >= self.BATCH or self._waited(queue[0]) >= self.BATCH_WAIT_S):
                while queue:
                    if not stopping and busy() and self._waited(queue[0]) < patience_s:
                        break  # a decision runs: build after it
                    self._publish(queue.popleft())
                    self._handled += 1
            if stopping and not queue:
                return
            self._stop.wait(self.POLL_S)

    def _waited(self, captured: Captured) -> float:
        return self._monotonic() - captured.queued_s

    def _publish(self, captured: Captured) -> None:
        start = time.perf_counter()
        try:
            value = build_record(captured, self._shape_parts(captured))
            self.publisher.publish(self.topic, captured.placement.cell.encode(), value)
        except Exception as exc:  # a bus that refuses, a record that cannot be built: counted, never fatal
            self.on_outcome("failed", 0)
            self._log_failure(type(exc).__name__, task_id=captured.placement.task_id, error=str(exc))
            return
        finally:
            self.build_s += time.perf_counter() - start
        self.published += 1
        self.published_bytes += len(value)
        self.on_outcome("published", len(value))

    def _shape_parts(self, captured: Captured) -> ShapeRecordParts:
        serial = captured.cache.serial
        if serial != self._parts_of:
            self._parts, self._parts_of = {}, serial
        parts = self._parts.get(captured.key)
        if parts is None or len(parts.listed) != len(captured.fastest.positions):
            parts = self._parts[captured.key] = shape_parts(captured)
        return parts


__all__ = ["OUTCOMES", "FeatureLog", "lock_busy"]
