"""One decision's ``hlb.v1.DecisionFeatures``, built from what :mod:`hlb.daemon.record.features`
captured under the daemon's lock, on the feature log's thread (no graph is read here).

Most of a record is the same for every decision of one task shape between two embedding
refreshes: the versions, the shape's flags and head input, the devices the model predicts
fastest, and what each device's entry says but for the decision's own figures. Those parts are
serialized once per shape and cache (:class:`ShapeRecordParts`) and joined with each record's own
fields as bytes. Serialized protobuf messages joined parse as one message with the fields of both,
and a sub-message given twice (``shape``, a candidate's ``neighbourhood``) is merged, so a record
reads as if built whole (``tests/daemon/test_feature_log.py`` parses them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.scorer import EmbeddingCache, ShapeKey
from hlb.daemon.state.graph import InfraGraph
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn

RECORD_VERSION = 1
PROPENSITY = 1.0  # the daemon places by its scores alone; a learner weighs examples by 1 / this
_LOG_PRIOR = "log_prior_speed"
# The key of a ``candidates`` entry on the wire: field 10, length-delimited.
_CANDIDATE_TAG = bytes([lrn.DecisionFeatures.CANDIDATES_FIELD_NUMBER << 3 | 2])


@dataclass(frozen=True)
class FastestDevices:
    """The ``top_k`` embedded devices the model predicts fastest for one shape in one cache.
    Shapes: ``positions`` [K] cache positions, fastest first."""

    positions: tuple[int, ...]
    device_ids: tuple[str, ...]
    models: tuple[str, ...]


@dataclass(frozen=True)
class DeviceSite:
    """What stays of a device while the inventory does: its id, model, host, rack and position in
    the embeddings (-1: none)."""

    position: int
    device_id: str
    model: str
    host_id: str
    rack_id: str
    host_devices: int


class Chosen(NamedTuple):
    """A chosen device as the decision left it (before its task was bound)."""

    site: DeviceSite
    device_tasks: int
    utilization: float
    memory_free_gb: float
    prior: NDArray[np.float32] | None  # [P], for a device without an embedding only


class Captured(NamedTuple):
    """What one decision hands the feature log's queue."""

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
    embeddings_age_ms: int
    queued_s: float  # monotonic, when queued


def device_site(graph: InfraGraph, cache: EmbeddingCache, row: int) -> DeviceSite:
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
    return DeviceSite(position, device_id, graph.model_of(row), host_id, rack_id, host_devices)


def chosen_device(graph: InfraGraph, site: DeviceSite, row: int, memory_gb: float) -> Chosen:
    """The device of ``row`` as a task of ``memory_gb`` per device was just bound to it, with that
    task and its memory taken off again."""
    d = graph.devices
    # As InfraGraph.free_memory_gb, on one row's scalars (a decision pays for this).
    used = float(d.memory_used_gb[row]) + float(d.placed_gb[row]) - memory_gb
    free = float(d.memory_gb[row]) - max(float(d.reserved_gb[row]) - memory_gb, used)
    return Chosen(site, max(0, int(d.n_tasks[row]) - 1), float(d.utilization[row]), free, None)


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
class ShapeRecordParts:
    """What every record of one shape in one cache shares (module docstring)."""

    common: bytes  # versions, the shape's flags and head input, the propensity, the devices embedded
    listed: tuple[bytes, ...]  # per FastestDevices position, its ``candidates`` entry
    sorted_speeds: NDArray[np.float64]  # ascending: ranks a chosen device outside the list
    chosen: dict[int, bytes] = field(default_factory=dict)  # position -> a chosen entry's shared part


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
        listed.append(_entry(device.SerializeToString()))
    spec, embeddings = captured.spec, captured.cache
    common = lrn.DecisionFeatures(
        record_version=RECORD_VERSION,
        feature_schema_version=feat.FEATURE_SCHEMA_VERSION,
        model_version=embeddings.model.version,
        shape=lrn.DecisionShape(
            workload_class=spec.workload_class, kind=spec.kind, gang=captured.gang, consolidated=captured.consolidated
        ),
        shape_features=feat.shape_features(spec, captured.gang, captured.consolidated).tolist(),
        propensity=PROPENSITY,
        embedded_devices=len(embeddings.device_rows),
    )
    return ShapeRecordParts(common.SerializeToString(), tuple(listed), np.sort(log_speeds(predictions, priors)))


def build_record(captured: Captured, parts: ShapeRecordParts | None = None) -> bytes:
    """The serialized record of one captured decision; ``parts``: its shape's, kept by the caller."""
    placement, spec = captured.placement, captured.spec
    parts = parts or shape_parts(captured)
    own = lrn.DecisionFeatures(
        cell=placement.cell,
        placement_sequence=placement.sequence,
        task_id=placement.task_id,
        decided_at_ms=placement.decided_at_ms,
        shape=lrn.DecisionShape(work_ref_s=spec.work_ref_s, memory_per_device_gb=spec.memory_per_device_gb),
        embeddings_age_ms=captured.embeddings_age_ms,
    )
    chosen_at = {c.site.position: g for g, c in enumerate(captured.chosen) if c.site.position >= 0}
    entries = [parts.common, own.SerializeToString()]
    listed = captured.fastest.positions
    for i, position in enumerate(listed):
        g = chosen_at.get(position)
        entries.append(parts.listed[i] if g is None else _chosen_entry(captured, parts, g))
    for g, chosen in enumerate(captured.chosen):
        if chosen.site.position < 0 or chosen.site.position not in listed:
            entries.append(_chosen_entry(captured, parts, g))
    return b"".join(entries)


def _chosen_entry(captured: Captured, parts: ShapeRecordParts, g: int) -> bytes:
    """The ``candidates`` entry of the ``g``-th chosen device: its shared part (once per position)
    and the decision's own figures."""
    chosen = captured.chosen[g]
    site = chosen.site
    shared = parts.chosen.get(site.position) if site.position >= 0 else None
    if shared is None:
        shared = _chosen_shared(captured, parts, chosen)
        if site.position >= 0:
            parts.chosen[site.position] = shared
    own = lrn.ScoredDevice(
        chosen=g + 1,
        neighbourhood=lrn.Neighbourhood(
            device_tasks=chosen.device_tasks, utilization=chosen.utilization, memory_free_gb=chosen.memory_free_gb
        ),
    )
    return _entry(shared + own.SerializeToString())


def _chosen_shared(captured: Captured, parts: ShapeRecordParts, chosen: Chosen) -> bytes:
    site, position = chosen.site, chosen.site.position
    device = lrn.ScoredDevice(
        device_id=site.device_id,
        model=site.model,
        neighbourhood=lrn.Neighbourhood(host_id=site.host_id, rack_id=site.rack_id, host_devices=site.host_devices),
    )
    if position < 0:  # no embedding: the profiles alone decided its speed
        device.prior_features.extend(chosen.prior.tolist() if chosen.prior is not None else [])
        return device.SerializeToString()
    prior = captured.priors[position]
    column = log_prior_column()
    speed = float(captured.predictions[position, 0]) + (float(prior[column]) if column is not None else 0.0)
    device.prior_features.extend(prior.tolist())
    device.log_speed_ratio = float(captured.predictions[position, 0])
    device.log_sigma = float(captured.predictions[position, 1])
    device.predicted = True
    device.rank = len(parts.sorted_speeds) - int(np.searchsorted(parts.sorted_speeds, speed, side="right"))
    return device.SerializeToString()


def _entry(body: bytes) -> bytes:
    """``body`` (a serialized ScoredDevice) as one ``candidates`` entry of a DecisionFeatures."""
    n, head = len(body), bytearray(_CANDIDATE_TAG)
    while n >= 0x80:  # the length as a base-128 varint
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + body


__all__ = [
    "PROPENSITY",
    "RECORD_VERSION",
    "Captured",
    "Chosen",
    "DeviceSite",
    "FastestDevices",
    "ShapeRecordParts",
    "build_record",
    "chosen_device",
    "device_site",
    "fastest",
    "log_prior_column",
    "shape_parts",
]
