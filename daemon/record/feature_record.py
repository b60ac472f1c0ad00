"""The feature log's records: ``hlb.v1.DecisionFeaturesBatch``, many GNN decisions of one cell
column by column, built on the feature log's thread from what :mod:`hlb.daemon.record.features`
captured under the daemon's lock (no graph is read here); and :func:`unfold`, which turns a
record back into one ``hlb.v1.DecisionFeatures`` per decision for a reader.

What every decision of one task shape shares between two embedding refreshes (the versions, the
shape's flags and head input, the devices the model predicts fastest) is one :class:`ShapeEntry`,
written once per record that holds such a decision (``shapes``); a decision adds one entry to
each per-decision column and, per chosen device, one to each per-device column. The chosen
devices' predictions, prior features and ranks are gathered with numpy, shape by shape, and so
is each decision's one embedding, of its label's device (:func:`_label_embeddings`), from the
cache the shape entry holds: a cache's arrays are never written once it is built (the scorer
encodes a new cache on each refresh, ``hlb.daemon.decide.gnn.scorer.GnnScorer._encode``, and
makes them read-only there), so a decision keeps a reference and its device's position, and
nothing is copied before the record is built. Record layouts 1 (one ``DecisionFeatures`` per
decision) and 2 (without the embedding and the context) are still read (:func:`unfold`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.scorer import EmbeddingCache
from hlb.daemon.state.graph import InfraGraph
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn

# DecisionFeaturesBatch; 2: without the head's embedding and context; 1: one DecisionFeatures a record
RECORD_VERSION = 3
EMBEDDING_DTYPE = np.dtype("<f2")  # a logged device embedding: float16, little-endian (learning.proto says why)
PROPENSITY = 1.0  # the daemon places by its scores alone; a learner weighs examples by 1 / this
_LOG_PRIOR = "log_prior_speed"


@dataclass(frozen=True)
class FastestDevices:
    """The ``top_k`` embedded devices the model predicts fastest for one shape in one cache.
    Shapes: ``positions`` [K] cache positions, fastest first."""

    positions: tuple[int, ...]
    device_ids: tuple[str, ...]
    models: tuple[str, ...]


class DeviceSite(NamedTuple):
    """What stays of a device while the inventory does: its id, model, host and rack (a tuple: a
    record's columns are its fields transposed)."""

    device_id: str
    model: str
    host_id: str
    rack_id: str
    host_devices: int


def device_site(graph: InfraGraph, row: int) -> DeviceSite:
    d = graph.devices
    host = int(d.host[row])
    host_id = rack_id = ""
    host_devices = 0
    if host >= 0:
        host_id = graph.hosts.ids[host] or ""
        host_devices = int(graph.hosts.n_devices[host])
        rack = int(graph.hosts.rack[host])
        if rack >= 0:
            rack_id = graph.switches.ids[rack] or ""
    return DeviceSite(d.ids[row] or "", graph.model_of(row), host_id, rack_id, host_devices)


def embedding_position(graph: InfraGraph, cache: EmbeddingCache, row: int) -> int:
    """Where the device of ``row`` is in ``cache``'s embeddings; -1: nowhere."""
    position = int(cache.positions[row]) if row < len(cache.positions) else -1
    if position >= 0 and graph.version != cache.version and cache.device_ids[row] != graph.devices.ids[row]:
        position = -1  # the row holds another device than when the embeddings were built
    return position


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


@dataclass
class ShapeEntry:
    """One task shape in one cache, as the first decision of it captured it (under the daemon's
    lock); what every record's ``shapes`` entry of it says is built once, on the log's thread.
    Shapes: ``predictions`` [D, 2], ``priors`` [D, P] of every cache position."""

    spec: ev.TaskSpec  # a decision's of the shape: its workload class and kind
    gang: int
    consolidated: bool
    cache: EmbeddingCache
    predictions: NDArray[np.float64]
    priors: NDArray[np.float32]
    fastest: FastestDevices
    message: lrn.BatchShape | None = None  # thread side (shape_message)
    sorted_speeds: NDArray[np.float64] | None = field(default=None, repr=False)  # ascending: ranks

    def shape_message(self) -> lrn.BatchShape:
        if self.message is None:
            self.message, self.sorted_speeds = _shape_message(self), np.sort(log_speeds(self.predictions, self.priors))
        return self.message


@dataclass
class Decisions:
    """Captured decisions, column by column (the feature log's queue): per decision, and per
    chosen device, decision by decision in gang order (a decision has its shape's ``gang``).

    A decision appends to every column, its devices' first and ``queued_s`` last; the log's thread
    :meth:`take` s the oldest meanwhile (each list operation is atomic under the interpreter's
    lock, and appends go to the ends, takes to the starts)."""

    placements: list[ev.Placement] = field(default_factory=list)
    specs: list[ev.TaskSpec] = field(default_factory=list)
    shapes: list[ShapeEntry] = field(default_factory=list)
    queued_s: list[float] = field(default_factory=list)  # monotonic, when queued
    sites: list[DeviceSite] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # in its shape's embeddings; -1: none
    device_tasks: list[int] = field(default_factory=list)  # before this task
    utilization: list[float] = field(default_factory=list)
    memory_free_gb: list[float] = field(default_factory=list)  # before this task
    priors: list[NDArray[np.float32] | None] = field(default_factory=list)  # [P] of a device without embedding

    def add_device(
        self,
        graph: InfraGraph,
        row: int,
        site: DeviceSite,
        position: int,
        memory_gb: float,
        prior: NDArray[np.float32] | None,
    ) -> None:
        """A chosen device (before :meth:`add` of its decision), as a task of ``memory_gb`` per
        device was just bound to it: its tasks, utilization and free memory without that task."""
        d = graph.devices
        # As InfraGraph.free_memory_gb, on one row's scalars (a decision pays for this).
        used = d.memory_used_gb.item(row) + d.placed_gb.item(row) - memory_gb
        self.memory_free_gb.append(d.memory_gb.item(row) - max(d.reserved_gb.item(row) - memory_gb, used))
        self.device_tasks.append(max(0, d.n_tasks.item(row) - 1))
        self.utilization.append(d.utilization.item(row))
        self.sites.append(site)
        self.positions.append(position)
        self.priors.append(prior)

    def add(self, placement: ev.Placement, spec: ev.TaskSpec, shape: ShapeEntry, now: float) -> None:
        """A decision whose chosen devices were just added (:meth:`add_device`)."""
        self.placements.append(placement)
        self.specs.append(spec)
        self.shapes.append(shape)
        self.queued_s.append(now)

    def take(self, n: int) -> Decisions:
        """The oldest ``n`` decisions (all of them appended whole), removed from these."""
        m = sum(shape.gang for shape in self.shapes[:n])
        out = Decisions()
        for name, k in _COLUMNS:
            column = getattr(self, name)
            getattr(out, name).extend(column[: n if k == "decision" else m])
            del column[: n if k == "decision" else m]
        return out

    def select(self, indices: list[int]) -> Decisions:
        """The decisions at ``indices`` (ascending), with their devices."""
        starts = np.cumsum([0] + [shape.gang for shape in self.shapes]).tolist()
        devices = [j for i in indices for j in range(starts[i], starts[i + 1])]
        out = Decisions()
        for name, k in _COLUMNS:
            column = getattr(self, name)
            getattr(out, name).extend([column[i] for i in (indices if k == "decision" else devices)])
        return out


_COLUMNS = (
    *((name, "decision") for name in ("placements", "specs", "shapes", "queued_s")),
    *((name, "device") for name in ("sites", "positions", "device_tasks", "utilization", "memory_free_gb", "priors")),
)


def _shape_message(entry: ShapeEntry) -> lrn.BatchShape:
    top, predictions, priors, spec = entry.fastest, entry.predictions, entry.priors, entry.spec
    message = lrn.BatchShape(
        feature_schema_version=feat.FEATURE_SCHEMA_VERSION,
        model_version=entry.cache.model.version,
        shape=lrn.DecisionShape(
            workload_class=spec.workload_class, kind=spec.kind, gang=entry.gang, consolidated=entry.consolidated
        ),
        shape_features=feat.shape_features(spec, entry.gang, entry.consolidated).tolist(),
        embedded_devices=len(entry.cache.device_rows),
        prior_width=priors.shape[1],
        context=entry.cache.context.tolist(),
    )
    for i, position in enumerate(top.positions):
        message.listed.append(
            lrn.ScoredDevice(
                device_id=top.device_ids[i],
                model=top.models[i],
                prior_features=priors[position].tolist(),
                log_speed_ratio=float(predictions[position, 0]),
                log_sigma=float(predictions[position, 1]),
                predicted=True,
                rank=i,
            )
        )
    return message


def build_batch(cell: str, decisions: Decisions) -> bytes:
    """The serialized ``DecisionFeaturesBatch`` of ``decisions`` (all of ``cell``, in ledger order)."""
    batch = lrn.DecisionFeaturesBatch(record_version=RECORD_VERSION, cell=cell)
    ids = [id(entry) for entry in decisions.shapes]
    index = {key: i for i, key in enumerate(dict.fromkeys(ids))}  # in order of first use
    by_id = dict(zip(ids, decisions.shapes, strict=True))
    entries = [by_id[key] for key in index]
    for entry in entries:
        batch.shapes.append(entry.shape_message())
    shape_of = list(map(index.__getitem__, ids))
    placements, specs = decisions.placements, decisions.specs
    batch.shape.extend(shape_of)
    batch.placement_sequence.extend([p.sequence for p in placements])
    batch.task_id.extend([p.task_id for p in placements])
    batch.decided_at_ms.extend([p.decided_at_ms for p in placements])
    batch.work_ref_s.extend([s.work_ref_s for s in specs])
    batch.memory_per_device_gb.extend([s.memory_per_device_gb for s in specs])
    built_at = np.array([entry.cache.built_at for entry in entries])[shape_of]
    ages = np.maximum(0, ((np.array(decisions.queued_s) - built_at) * 1000).astype(np.int64))
    batch.embeddings_age_ms.extend(ages.tolist())
    batch.propensity.extend([PROPENSITY] * len(placements))
    _devices(batch, decisions, shape_of, entries)
    return batch.SerializeToString()


def _label_embeddings(
    entries: list[ShapeEntry],
    shape_index: NDArray[np.int64],
    entry_of: NDArray[np.int64],
    positions: NDArray[np.int64],
    priors: NDArray[np.float32],
) -> list[bytes]:
    """Per decision, the float16 bytes of its label's device's embedding (``training_rows`` calls
    it the bounding device: the chosen one with the lowest prior log speed, the first in gang order
    on ties), gathered from its shape's cache, as the decision read it; empty without one.
    ``shape_index`` [N] per decision, ``entry_of`` / ``positions`` [M] / ``priors`` [M, P] per
    chosen device -> [N]."""
    out = [b""] * len(shape_index)
    column = log_prior_column()
    for e, entry in enumerate(entries):
        decided = np.flatnonzero(shape_index == e)  # its decisions, in order; their devices likewise
        devices = np.flatnonzero(entry_of == e).reshape(len(decided), entry.gang)
        first = np.zeros(len(decided), dtype=np.int64)
        if column is not None:
            first = np.argmin(priors[devices, column], axis=1)  # the first of the lowest
        where = positions[devices[np.arange(len(decided)), first]]
        embedded = where >= 0
        emb = entry.cache.device_emb
        data, width = emb[where[embedded]].astype(EMBEDDING_DTYPE).tobytes(), emb.shape[1] * EMBEDDING_DTYPE.itemsize
        for k, i in enumerate(decided[embedded].tolist()):
            out[i] = data[k * width : (k + 1) * width]
    return out


def _devices(
    batch: lrn.DecisionFeaturesBatch, decisions: Decisions, shape_of: list[int], entries: list[ShapeEntry]
) -> None:
    """The per-device columns: sites and neighbourhoods as captured, predictions and prior
    features gathered shape by shape."""
    sites = decisions.sites
    n, width = len(sites), entries[0].priors.shape[1] if entries else 0
    shape_index = np.array(shape_of, dtype=np.int64)
    entry_of = np.repeat(shape_index, np.array([entry.gang for entry in entries], dtype=np.int64)[shape_index])
    positions = np.array(decisions.positions, dtype=np.int64)
    ratio, sigma = np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.float64)
    rank, priors = np.zeros(n, dtype=np.int64), np.zeros((n, width), dtype=np.float32)
    column = log_prior_column()
    for e, entry in enumerate(entries):
        at = np.flatnonzero((entry_of == e) & (positions >= 0))
        if not len(at):
            continue
        where = positions[at]
        ratio[at], sigma[at] = entry.predictions[where, 0], entry.predictions[where, 1]
        priors[at] = entry.priors[where]
        speed = ratio[at] + (priors[at, column] if column is not None else 0.0)
        assert entry.sorted_speeds is not None  # shape_message made it
        rank[at] = len(entry.sorted_speeds) - np.searchsorted(entry.sorted_speeds, speed, side="right")
    for i in np.flatnonzero(positions < 0).tolist():  # no embedding: the profiles alone decided its speed
        prior = decisions.priors[i]
        if prior is not None:
            priors[i] = prior
    site_index = {site: i for i, site in enumerate(dict.fromkeys(sites))}  # each device once a record
    batch.site.extend(list(map(site_index.__getitem__, sites)))
    device_ids, models, host_ids, rack_ids, host_devices = zip(*site_index, strict=True) if sites else ((),) * 5
    batch.device_id.extend(device_ids)
    batch.device_model.extend(models)
    batch.prior_features.extend(priors.ravel().tolist())
    batch.log_speed_ratio.extend(ratio.tolist())
    batch.log_sigma.extend(sigma.tolist())
    batch.predicted.extend((positions >= 0).tolist())
    batch.rank.extend(rank.tolist())
    batch.host_id.extend(host_ids)
    batch.rack_id.extend(rack_ids)
    batch.host_devices.extend(host_devices)
    batch.device_tasks.extend(decisions.device_tasks)
    batch.utilization.extend(decisions.utilization)
    batch.memory_free_gb.extend(decisions.memory_free_gb)
    batch.device_embedding.extend(_label_embeddings(entries, shape_index, entry_of, positions, priors))


class MalformedRecordError(ValueError):
    """A feature record whose columns do not line up."""


def unfold(batch: lrn.DecisionFeaturesBatch) -> list[lrn.DecisionFeatures]:
    """A batch's decisions, one ``DecisionFeatures`` each, in record order, as a record of layout 1
    held one. Raises ``MalformedRecordError`` when its columns do not line up."""
    n = len(batch.shape)
    per_decision = (
        batch.placement_sequence,
        batch.task_id,
        batch.decided_at_ms,
        batch.work_ref_s,
        batch.memory_per_device_gb,
        batch.embeddings_age_ms,
        batch.propensity,
    )
    if any(len(c) != n for c in per_decision) or any(i >= len(batch.shapes) for i in batch.shape):
        raise MalformedRecordError(f"a batch of {n} decisions whose per-decision columns differ in length")
    embeddings = batch.device_embedding
    if (len(embeddings) != n if batch.record_version >= 3 else len(embeddings) > 0) or any(
        len(e) % EMBEDDING_DTYPE.itemsize for e in embeddings
    ):
        raise MalformedRecordError(f"a batch of {n} decisions whose device embeddings do not line up")
    m = sum(batch.shapes[i].shape.gang for i in batch.shape)
    per_device = (
        batch.site,
        batch.log_speed_ratio,
        batch.log_sigma,
        batch.predicted,
        batch.rank,
        batch.device_tasks,
        batch.utilization,
        batch.memory_free_gb,
    )
    widths = {s.prior_width for s in batch.shapes}
    width = widths.pop() if len(widths) == 1 else -1
    if any(len(c) != m for c in per_device) or (m and len(batch.prior_features) != m * width):
        raise MalformedRecordError(f"a batch of {m} chosen devices whose per-device columns differ in length")
    k = len(batch.device_id)
    per_site = (batch.device_model, batch.host_id, batch.rack_id, batch.host_devices)
    if any(len(c) != k for c in per_site) or any(i >= k for i in batch.site):
        raise MalformedRecordError(f"a batch of {k} devices whose site columns differ in length")
    out, d = [], 0
    for i in range(n):
        shape = batch.shapes[batch.shape[i]]
        record = lrn.DecisionFeatures(
            record_version=batch.record_version,
            feature_schema_version=shape.feature_schema_version,
            model_version=shape.model_version,
            cell=batch.cell,
            placement_sequence=batch.placement_sequence[i],
            task_id=batch.task_id[i],
            decided_at_ms=batch.decided_at_ms[i],
            shape=shape.shape,
            shape_features=shape.shape_features,
            candidates=shape.listed,
            propensity=batch.propensity[i],
            embedded_devices=shape.embedded_devices,
            embeddings_age_ms=batch.embeddings_age_ms[i],
        )
        record.shape.work_ref_s = batch.work_ref_s[i]
        record.shape.memory_per_device_gb = batch.memory_per_device_gb[i]
        if batch.record_version >= 3:
            record.device_embedding.extend(np.frombuffer(embeddings[i], dtype=EMBEDDING_DTYPE).tolist())
            record.context.extend(shape.context)
        listed = {c.device_id: c for c in record.candidates}
        for g in range(shape.shape.gang):
            at = batch.site[d]
            device = listed.get(batch.device_id[at]) if batch.predicted[d] else None
            if device is None:  # not among the listed: after them
                device = record.candidates.add(
                    device_id=batch.device_id[at],
                    model=batch.device_model[at],
                    prior_features=batch.prior_features[d * width : (d + 1) * width],
                )
                if batch.predicted[d]:
                    device.log_speed_ratio, device.log_sigma = batch.log_speed_ratio[d], batch.log_sigma[d]
                    device.predicted, device.rank = True, batch.rank[d]
            device.chosen = g + 1
            device.neighbourhood.CopyFrom(
                lrn.Neighbourhood(
                    host_id=batch.host_id[at],
                    rack_id=batch.rack_id[at],
                    host_devices=batch.host_devices[at],
                    device_tasks=batch.device_tasks[d],
                    utilization=batch.utilization[d],
                    memory_free_gb=batch.memory_free_gb[d],
                )
            )
            d += 1
        out.append(record)
    return out


__all__ = [
    "EMBEDDING_DTYPE",
    "PROPENSITY",
    "RECORD_VERSION",
    "Decisions",
    "DeviceSite",
    "FastestDevices",
    "MalformedRecordError",
    "ShapeEntry",
    "build_batch",
    "device_site",
    "embedding_position",
    "fastest",
    "log_prior_column",
    "unfold",
]
