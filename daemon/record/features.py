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

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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
from hlb.daemon.state.tables import Rows
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

    positions: NDArray[np.int64]
    device_ids: tuple[str, ...]
    models: tuple[str, ...]


@dataclass(frozen=True)
class Captured:
    """What one decision hands the queue: references and the chosen devices' few fields, read
    under the daemon's lock; the record is built from them on the log's thread."""

    placement: ev.Placement
    spec: ev.TaskSpec
    gang: int
    consolidated: bool
    model_version: str
    cache: EmbeddingCache
    predictions: NDArray[np.float64]  # [D, 2] of every cache position
    priors: NDArray[np.float32]  # [D, P]
    fastest: FastestDevices
    chosen_positions: NDArray[np.int64]  # [G], -1 for a device without an embedding
    chosen_priors: NDArray[np.float32]  # [G, P]
    chosen_models: tuple[str, ...]
    neighbourhoods: tuple[lrn.Neighbourhood, ...]
    embeddings_age_ms: int


def neighbourhood(graph: InfraGraph, row: int, memory_gb: float) -> lrn.Neighbourhood:
    """Where the device of ``row`` sits, as a task of ``memory_gb`` per device was just bound to
    it (so its own task and memory are taken off again)."""
    devices = graph.devices
    host = int(devices.host[row])
    host_id = rack_id = ""
    host_devices = 0
    if host >= 0:
        host_id = graph.hosts.ids[host] or ""
        host_devices = int(graph.hosts.n_devices[host])
        rack = int(graph.hosts.rack[host])
        if rack >= 0:
            rack_id = graph.switches.ids[rack] or ""
    free = float(graph.free_memory_gb(np.array([row], dtype=np.int64))[0]) + memory_gb
    return lrn.Neighbourhood(
        host_id=host_id,
        rack_id=rack_id,
        host_devices=host_devices,
        device_tasks=max(0, int(devices.n_tasks[row]) - 1),
        utilization=float(devices.utilization[row]),
        memory_free_gb=free,
    )


def log_prior_column() -> int | None:
    """Where the log of the profiles' speed is among the prior features (None: the schema has none)."""
    names = feat.names(feat.PRIOR_FEATURES)
    return names.index(_LOG_PRIOR) if _LOG_PRIOR in names else None


def fastest(
    cache: EmbeddingCache, graph: InfraGraph, predictions: NDArray[np.float64], priors: NDArray[np.float32], k: int
) -> FastestDevices:
    """The ``k`` cache positions with the highest predicted speed (the profiles' speed times the
    predicted ratio), fastest first. [D, 2], [D, P] -> [K]."""
    n = len(predictions)
    k = min(k, n)
    if k == 0:
        return FastestDevices(np.zeros(0, dtype=np.int64), (), ())
    column = log_prior_column()
    log_speed = predictions[:, 0] + (priors[:, column] if column is not None else 0.0)
    top = np.argpartition(-log_speed, k - 1)[:k] if k < n else np.arange(n)
    top = top[np.argsort(-log_speed[top], kind="stable")].astype(np.int64)
    rows = cache.device_rows[top]
    ids = tuple(cache.device_ids[int(r)] or "" for r in rows)
    return FastestDevices(top, ids, tuple(graph.model_of(int(r)) for r in rows))


def build_record(captured: Captured) -> lrn.DecisionFeatures:
    """The record of one captured decision (on the log's thread: no graph is read here)."""
    placement, spec, cache = captured.placement, captured.spec, captured.cache
    predictions, priors, top = captured.predictions, captured.priors, captured.fastest
    record = lrn.DecisionFeatures(
        record_version=RECORD_VERSION,
        feature_schema_version=feat.FEATURE_SCHEMA_VERSION,
        model_version=captured.model_version,
        cell=placement.cell,
        placement_sequence=placement.sequence,
        task_id=placement.task_id,
        decided_at_ms=placement.decided_at_ms,
        shape=lrn.DecisionShape(
            workload_class=spec.workload_class,
            kind=spec.kind,
            gang=captured.gang,
            consolidated=captured.consolidated,
            work_ref_s=spec.work_ref_s,
            memory_per_device_gb=spec.memory_per_device_gb,
        ),
        shape_features=feat.shape_features(spec, captured.gang, captured.consolidated).tolist(),
        propensity=PROPENSITY,
        embedded_devices=len(cache.device_rows),
        embeddings_age_ms=captured.embeddings_age_ms,
    )
    rank_of = {int(p): i for i, p in enumerate(top.positions.tolist())}
    chosen_at = {int(p): g for g, p in enumerate(captured.chosen_positions.tolist()) if p >= 0}
    for i, position in enumerate(top.positions.tolist()):
        device = record.candidates.add(
            device_id=top.device_ids[i],
            model=top.models[i],
            prior_features=priors[position].tolist(),
            log_speed_ratio=float(predictions[position, 0]),
            log_sigma=float(predictions[position, 1]),
            predicted=True,
            rank=i,
        )
        g = chosen_at.get(position)
        if g is not None:
            device.chosen = g + 1
            device.neighbourhood.CopyFrom(captured.neighbourhoods[g])
    for g, position in enumerate(captured.chosen_positions.tolist()):
        if position >= 0 and position in rank_of:
            continue
        device = record.candidates.add(
            device_id=placement.device_ids[g],
            model=captured.chosen_models[g],
            prior_features=captured.chosen_priors[g].tolist(),
            chosen=g + 1,
            neighbourhood=captured.neighbourhoods[g],
        )
        if position >= 0:
            device.predicted = True
            device.log_speed_ratio = float(predictions[position, 0])
            device.log_sigma = float(predictions[position, 1])
            device.rank = _rank(predictions, priors, position)
    return record


def _rank(predictions: NDArray[np.float64], priors: NDArray[np.float32], position: int) -> int:
    """How many embedded devices the model predicts faster than the one at ``position``."""
    column = log_prior_column()
    log_speed = predictions[:, 0] + (priors[:, column] if column is not None else 0.0)
    return int(np.count_nonzero(log_speed > log_speed[position]))


class FeatureLog:
    """The ledger listener that logs the GNN's decisions (module docstring).

    ``publisher``: where records go (the daemon gives it a producer of its own, so that the ledger
    never queues behind features); ``on_outcome``: counts each record's fate (:data:`OUTCOMES`)
    and its bytes. :meth:`start` the thread, :meth:`stop` it (publishing what is queued first)."""

    def __init__(
        self,
        scheduler: Scheduler,
        publisher: Publisher,
        topic: str,
        *,
        top_k: int = 8,
        queue_size: int = 10_000,
        on_outcome: Outcome | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.publisher = publisher
        self.topic = topic
        self.top_k = top_k
        self.enabled = True  # off: decisions are not looked at (``hlb bench features`` toggles it)
        self.on_outcome: Outcome = on_outcome or (lambda outcome, size: None)
        self._queue: queue.Queue[Captured | None] = queue.Queue(maxsize=queue_size)
        self._monotonic = monotonic
        self._fastest: dict[ShapeKey, FastestDevices] = {}
        self._fastest_of = -1  # the cache serial ``_fastest`` belongs to
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
        captured = self._capture(scorer, placement, task.spec, np.asarray(task.device_rows, dtype=np.int64))
        if captured is None:
            self.on_outcome("skipped", 0)
            return
        try:
            self._queue.put_nowait(captured)
        except queue.Full:
            self.on_outcome("dropped", 0)

    def _capture(self, scorer: GnnScorer, placement: ev.Placement, spec: ev.TaskSpec, rows: Rows) -> Captured | None:
        graph = self.scheduler.graph
        gang = len(rows)
        consolidated = gang == 1 or len(np.unique(graph.devices.host[rows])) == 1
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
        positions = cache.known_positions(graph, rows)
        chosen_priors = np.zeros((gang, priors.shape[1]), dtype=np.float32)
        known = positions >= 0
        chosen_priors[known] = priors[positions[known]]
        if not known.all():  # a device newer than the embeddings: its prior features computed now
            missing = rows[~known]
            chosen_priors[~known] = feat.prior_features(
                spec, graph, missing, scorer.fallback.profiles, gang, consolidated
            )
        memory_gb = spec.memory_per_device_gb
        return Captured(
            placement=placement,
            spec=spec,
            gang=gang,
            consolidated=consolidated,
            model_version=cache.model.version,
            cache=cache,
            predictions=predictions,
            priors=priors,
            fastest=top,
            chosen_positions=positions,
            chosen_priors=chosen_priors,
            chosen_models=tuple(graph.model_of(int(r)) for r in rows),
            neighbourhoods=tuple(neighbourhood(graph, int(r), memory_gb) for r in rows),
            embeddings_age_ms=max(0, int((self._monotonic() - cache.built_at) * 1000)),
        )

    # -- the log's thread -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="feature-log", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> int:
        """Publish what is queued, stop the thread and flush the publisher; returns the records the
        publisher still held undelivered after ``timeout_s``."""
        if self._thread is not None:
            self._queue.put(None)  # after everything queued: the thread publishes it first
            self._thread.join(timeout_s)
            self._thread = None
        return self.publisher.flush(timeout_s)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued record has been handled (published, or counted failed); False
        when ``timeout_s`` passed first."""
        deadline = self._monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if self._monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def _run(self) -> None:
        while True:
            captured = self._queue.get()
            try:
                if captured is None:
                    return
                self._publish(captured)
            finally:
                self._queue.task_done()

    def _publish(self, captured: Captured) -> None:
        try:
            value = build_record(captured).SerializeToString()
            self.publisher.publish(self.topic, captured.placement.cell.encode(), value)
        except Exception as exc:  # a bus that refuses, a record that cannot be built: counted, never fatal
            self.on_outcome("failed", 0)
            self._log_failure(type(exc).__name__, task_id=captured.placement.task_id, error=str(exc))
            return
        self.published += 1
        self.published_bytes += len(value)
        self.on_outcome("published", len(value))


__all__ = ["OUTCOMES", "PROPENSITY", "RECORD_VERSION", "FeatureLog", "build_record", "neighbourhood"]
