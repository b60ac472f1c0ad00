"""Decision features on Kafka: what the GNN read and predicted for each of its decisions.

With ``learning.log_features`` on, :class:`FeatureLog` listens to the placement ledger (as the
publisher of the ledger topic does) and writes, for each placement the GNN policy decided, one
``hlb.v1.DecisionFeatures`` to ``learning.topic``, keyed by the cell as the ledger is: the task's
shape and the speed head's task input, the devices the model predicts fastest for that shape
(``learning.top_k``, of every device it has an embedding of) and the chosen ones, each with the
head's prior features (the log of the profiles' speed first), the predicted log speed ratio and
log standard deviation, where a chosen device sits (:func:`neighbourhood`), the model and feature
schema versions, and the propensity of the choice (1: the daemon does not explore). The device
embeddings are not logged: 32 floats a device, and a learner re-encodes the graph anyway.

Off the request path. The listener runs inside the decision, under the daemon's lock: it reads
what the scorer kept of the shape (:meth:`GnnScorer.shape_inputs`, array references), the
chosen devices' few fields, and the fastest devices of the shape (once per shape and embedding
refresh), then hands them to a bounded queue without waiting. A thread builds each record and
publishes it; a full queue drops the record and counts it, a record the bus refuses is counted
too. Nothing here can fail or slow a decision beyond those reads.

A record may outlive its decision: a placement the ledger topic refused is undone
(``DecisionPublisher.take_back``) after its record was queued. Readers join records with the
ledger (``hlb features tail``), so such a record joins nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import numpy as np
import structlog
from numpy.typing import NDArray

from hlb.daemon.bus.kafkalog import FoldedLog
from hlb.daemon.bus.seam import Publisher
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.scorer import EmbeddingCache, GnnScorer, ShapeKey, shape_key
from hlb.daemon.decide.presets import gnn_scorer
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn

log = structlog.get_logger(__name__)

RECORD_VERSION = 1
PROPENSITY = 1.0  # the daemon places by its scores alone; a learner weighs examples by 1 / this
# What a record's fate is counted as (hlb_feature_records_total's outcome label).
OUTCOMES = ("published", "dropped", "skipped", "failed")
Outcome = Callable[[str, int], None]  # (outcome, bytes: the record's size when published, else 0)

_LOG_PRIOR = "log_prior_speed"


@dataclass(frozen=True)
class FastestDevices:
    """The ``top_k`` embedded devices the model predicts fastest for one shape in one cache, read
    under the lock once per (cache, shape). Shapes: ``positions`` [K] cache positions, fastest first."""

    positions: tuple[int, ...]
    device_ids: tuple[str, ...]
    models: tuple[str, ...]


class Chosen(NamedTuple):
    """A chosen device as the decision left it, read under the lock (plain values: cheap to take)."""

    position: int  # in the cache; -1: no embedding
    device_id: str
    model: str
    host_id: str
    rack_id: str
    host_devices: int
    device_tasks: int  # before this task
    utilization: float
    memory_free_gb: float  # before this task
    prior: NDArray[np.float32] | None  # [P] for a device without an embedding, else read from the cache


class Captured(NamedTuple):
    """What one decision hands the queue: references and the chosen devices' few fields, read
    under the daemon's lock; the record is built from them on the log's thread."""

    placement: ev.Placement
    spec: ev.TaskSpec
    key: ShapeKey
    gang: int
    consolidated: bool
    cache: EmbeddingCache
    predictions: NDArray[np.float64]  # [D, 2] of every cache position
    priors: NDArray[np.float32]  # [D, P]
    fastest: FastestDevices
    chosen: tuple[Chosen, ...]
    built_ms: int  # the embeddings' age when decided
    queued_s: float  # monotonic, when queued


def chosen_device(graph: InfraGraph, cache: EmbeddingCache, row: int, memory_gb: float) -> Chosen:
    """The device of ``row`` as a task of ``memory_gb`` per device was just bound to it (its own
    task and memory taken off again), and its position in ``cache`` (-1: none)."""
    d = graph.devices
    position = int(cache.positions[row]) if row < len(cache.positions) else -1
    device_id = d.ids[row] or ""
    if position >= 0 and graph.version != cache.version and cache.device_ids[row] != device_id:
        position = -1  # the row holds another device than when the embeddings were built
    host = int(d.host[row])
    host_id = rack_id = ""
    host_devices = 0
    if host >= 0:
        host_id = graph.hosts.ids[host] or ""
        host_devices = int(graph.hosts.n_devices[host])
        rack = int(graph.hosts.rack[host])
        if rack >= 0:
            rack_id = graph.switches.ids[rack] or ""
    # As graph.free_memory_gb, on one row's scalars (a decision pays for this).
    used = float(d.memory_used_gb[row]) + float(d.placed_gb[row]) - memory_gb
    free = float(d.memory_gb[row]) - max(float(d.reserved_gb[row]) - memory_gb, used)
    return Chosen(
        position,
        device_id,
        graph.model_of(row),
        host_id,
        rack_id,
        host_devices,
        max(0, int(d.n_tasks[row]) - 1),
        float(d.utilization[row]),
        free,
        None,
    )


def lock_busy(lock: threading.RLock) -> Callable[[], bool]:
    """Whether another thread holds ``lock`` now (a probe: taken and released at once when free)."""

    def busy() -> bool:
        if lock.acquire(blocking=False):
            lock.release()
            return False
        return True

    return busy


@cache
def log_prior_column() -> int | None:
    """Where the log of the profiles' speed is among the prior features (None: the schema has none)."""
    names = feat.names(feat.PRIOR_FEATURES)
    return names.index(_LOG_PRIOR) if _LOG_PRIOR in names else None


def log_speeds(predictions: NDArray[np.float64], priors: NDArray[np.float32]) -> NDArray[np.float64]:
    """The predicted log speed of every position: the profiles' log speed plus the predicted log
    ratio (the ratio alone where the schema lists no prior speed). [D, 2], [D, P] -> [D]."""
    column = log_prior_column()
    out: NDArray[np.float64] = predictions[:, 0] + (priors[:, column] if column is not None else 0.0)
    return out


def fastest(
    cache: EmbeddingCache, graph: InfraGraph, predictions: NDArray[np.float64], priors: NDArray[np.float32], k: int
) -> FastestDevices:
    """The ``k`` cache positions with the highest predicted speed, fastest first. -> [K]."""
    n = len(predictions)
    k = min(k, n)
    if k == 0:
        return FastestDevices((), (), ())
    speed = log_speeds(predictions, priors)
    top = np.argpartition(-speed, k - 1)[:k] if k < n else np.arange(n)
    top = top[np.argsort(-speed[top], kind="stable")]
    rows = cache.device_rows[top].tolist()
    return FastestDevices(
        tuple(top.tolist()), tuple(cache.device_ids[r] or "" for r in rows), tuple(graph.model_of(r) for r in rows)
    )


@dataclass(frozen=True)
class ShapeRecordParts:
    """What every record of one shape in one cache shares, built once on the log's thread: the
    fields every such record carries alike (serialized), each listed device's serialized entry,
    and the sorted predicted speeds that rank a chosen device outside the list."""

    common: bytes  # versions, the shape's flags and head input, the propensity, the devices embedded
    listed: tuple[bytes, ...]  # per FastestDevices position, a serialized ``candidates`` entry
    sorted_speeds: NDArray[np.float64]  # ascending


def shape_parts(captured: Captured) -> ShapeRecordParts:
    top, predictions, priors = captured.fastest, captured.predictions, captured.priors
    listed = []
    for i, position in enumerate(top.positions):
        device = lrn.ScoredDevice(
            device_id=top.device_ids[i],
            model=top.models[i],
            prior_features=priors[position].tolist(),
            log_speed_ratio=float(predictions[position, 0]),
            log_sigma=float(predictions[position, 1]),
            predicted=True,
            rank=i,
        )
        listed.append(lrn.DecisionFeatures(candidates=[device]).SerializeToString())
    spec, cache = captured.spec, captured.cache
    common = lrn.DecisionFeatures(
        record_version=RECORD_VERSION,
        feature_schema_version=feat.FEATURE_SCHEMA_VERSION,
        model_version=cache.model.version,
        shape=lrn.DecisionShape(
            workload_class=spec.workload_class, kind=spec.kind, gang=captured.gang, consolidated=captured.consolidated
        ),
        shape_features=feat.shape_features(spec, captured.gang, captured.consolidated).tolist(),
        propensity=PROPENSITY,
        embedded_devices=len(cache.device_rows),
    )
    return ShapeRecordParts(
        common.SerializeToString(),
        tuple(listed),
        np.sort(log_speeds(predictions, priors)),
    )


def build_record(captured: Captured, parts: ShapeRecordParts | None = None) -> bytes:
    """The serialized record of one captured decision (on the log's thread: no graph is read).

    What every record of the shape and cache shares is serialized once (``parts``) and joined
    with this record's own fields as bytes: serialized protobuf messages joined parse as one
    message with the fields of both (a sub-message given twice, ``shape`` here, is merged), so the
    record reads as if built whole (tested)."""
    placement, spec = captured.placement, captured.spec
    predictions, priors, top = captured.predictions, captured.priors, captured.fastest
    parts = parts or shape_parts(captured)
    head = lrn.DecisionFeatures(
        cell=placement.cell,
        placement_sequence=placement.sequence,
        task_id=placement.task_id,
        decided_at_ms=placement.decided_at_ms,
        shape=lrn.DecisionShape(work_ref_s=spec.work_ref_s, memory_per_device_gb=spec.memory_per_device_gb),
        embeddings_age_ms=captured.built_ms,
    )
    chosen_rank = {c.position: g for g, c in enumerate(captured.chosen) if c.position >= 0}
    listed = list(parts.listed)
    fresh = lrn.DecisionFeatures()
    for i, position in enumerate(top.positions):
        g = chosen_rank.get(position)
        if g is not None:  # a listed device that was chosen: its entry says so
            fresh.candidates.append(_scored(captured, g, i))
            listed[i] = fresh.SerializeToString()
            fresh.Clear()
    in_list = set(top.positions)
    speed = parts.sorted_speeds
    for g, chosen in enumerate(captured.chosen):
        if chosen.position >= 0 and chosen.position in in_list:
            continue
        rank = 0
        if chosen.position >= 0:
            mine = float(predictions[chosen.position, 0]) + _log_prior(priors[chosen.position])
            rank = len(speed) - int(np.searchsorted(speed, mine, side="right"))
        fresh.candidates.append(_scored(captured, g, rank))
    return b"".join((parts.common, head.SerializeToString(), *listed, fresh.SerializeToString()))


def _log_prior(prior: NDArray[np.float32]) -> float:
    column = log_prior_column()
    return float(prior[column]) if column is not None else 0.0


def _scored(captured: Captured, g: int, rank: int) -> lrn.ScoredDevice:
    chosen = captured.chosen[g]
    position = chosen.position
    known = position >= 0
    prior = captured.priors[position] if known else chosen.prior
    return lrn.ScoredDevice(
        device_id=chosen.device_id,
        model=chosen.model,
        prior_features=prior.tolist() if prior is not None else [],
        log_speed_ratio=float(captured.predictions[position, 0]) if known else 0.0,
        log_sigma=float(captured.predictions[position, 1]) if known else 0.0,
        predicted=known,
        rank=rank,
        chosen=g + 1,
        neighbourhood=lrn.Neighbourhood(
            host_id=chosen.host_id,
            rack_id=chosen.rack_id,
            host_devices=chosen.host_devices,
            device_tasks=chosen.device_tasks,
            utilization=chosen.utilization,
            memory_free_gb=chosen.memory_free_gb,
        ),
    )


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

    # Each wake takes the interpreter's lock from whatever runs: seldom, and longer while busy.
    POLL_S = 0.005
    BUSY_POLL_S = 0.01

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
        self._fastest: dict[ShapeKey, FastestDevices] = {}  # of the cache ``_fastest_of`` (lock side)
        self._fastest_of = -1
        self._parts: dict[ShapeKey, ShapeRecordParts] = {}  # of the cache ``_parts_of`` (thread side)
        self._parts_of = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        self.published_bytes = 0
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
        if inputs is None:
            return None
        cache, predictions, priors = inputs
        if cache.serial != self._fastest_of:
            self._fastest, self._fastest_of = {}, cache.serial
        key = shape_key(spec, gang, consolidated)
        top = self._fastest.get(key)
        if top is None:
            top = self._fastest[key] = fastest(cache, graph, predictions, priors, self.top_k)
        memory_gb = spec.memory_per_device_gb
        chosen = [chosen_device(graph, cache, r, memory_gb) for r in rows]
        for g, device in enumerate(chosen):
            if device.position < 0:  # a device newer than the embeddings: its prior features now
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
            while queue:
                if not stopping and busy() and self._monotonic() - queue[0].queued_s < patience_s:
                    break  # a decision runs: build after it
                self._publish(queue.popleft())
                self._handled += 1
            if stopping and not queue:
                return
            self._stop.wait(self.BUSY_POLL_S if queue else self.POLL_S)

    def _publish(self, captured: Captured) -> None:
        try:
            value = build_record(captured, self._shape_parts(captured))
            self.publisher.publish(self.topic, captured.placement.cell.encode(), value)
        except Exception as exc:  # a bus that refuses, a record that cannot be built: counted, never fatal
            self.on_outcome("failed", 0)
            self._log_failure(type(exc).__name__, task_id=captured.placement.task_id, error=str(exc))
            return
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


__all__ = ["OUTCOMES", "PROPENSITY", "RECORD_VERSION", "FeatureLog", "build_record", "lock_busy", "log_prior_column"]
