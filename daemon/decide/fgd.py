"""Fragmentation of shared devices, and the FGD-style baseline that places to grow it least.

A cluster whose devices are shared (docs/fractional.md) fragments: a device with 300 milli-devices
free cannot take a request for 470, nor a whole-device task; a partition of 142 cannot take 320.
Following the FGD paper (Weng et al., "Beware of Fragmentation", USENIX ATC'23), the free capacity
of a device that a request *cannot* use is that request's fragment there, and the fragmentation
of the cluster is its expectation over the requests the workload makes (:class:`RequestMix`):

    F = sum over request types k of w_k * sum over devices g of free_g * [k cannot use g]

in milli-devices (``/ 1000``: GPU-equivalents). What each device offers (``free_g``):

- a shareable device: its capacity less the shares held there; a share ``s`` uses it when
  ``s <= free`` and its memory fits; a whole-device request only when nothing is held there;
- a partition: its compute share while it and its parent hold no task; a share ``s`` uses it when
  ``s <=`` that compute share and its memory fits; a whole-device request when the parent could be
  taken whole (none of its partitions holds a task) and the parent's memory fits;
- an exclusive device without partitions: all of it while it holds no task, for whole-device
  requests only; a device with partitions offers its capacity through them (counted once).

A whole-device request is counted as one device (gangs of several may span hosts here, unlike the
paper's nodes). Memory is the memory hlb reserved (``reserved_gb``), not the reported use, so the
measure does not move with telemetry noise. Failed devices offer nothing.

:class:`FragmentationGradient` (preset ``fgd``) scores each feasible device by how much placing
the task there would change F (the FGD rule: least growth first), against the mix of the
requests it has placed (the last :data:`MIX_WINDOW`, by share and memory): an estimate of the
workload's distribution, which starts from the task being placed. Ties (within
:data:`TIE_GPUS`) go to the earliest estimated finish (hetero-greedy's score). Written from the
paper's definitions; its code is not used.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.framework import ObjectiveWeights, Policy, Scores
from hlb.daemon.decide.scorers import HeteroGreedy
from hlb.daemon.state.checks import WHOLE_SHARE
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

MIX_WINDOW = 1000  # placed requests the scorer's mix remembers
MIX_TYPES = 32  # request types (share, memory) the mix keeps, most frequent first
TIE_GPUS = 1e-4  # fragmentation changes below this (GPU-equivalents) count as ties


@dataclass(frozen=True)
class RequestMix:
    """Request types and how often each comes: ``share_milli`` (0: a whole device), ``memory_gb``
    and ``weight`` (summing to 1). Shapes: each [K]."""

    share_milli: NDArray[np.int64]
    memory_gb: NDArray[np.float64]
    weight: NDArray[np.float64]

    @classmethod
    def of(cls, requests: Iterable[tuple[int, float]], limit: int = 0) -> RequestMix:
        """The mix of ``(share_milli, memory_gb)`` requests, each type weighted by its count (the
        ``limit`` most frequent types when above 0). ValueError when there is none."""
        counts = Counter((int(s), float(m)) for s, m in requests)
        if not counts:
            raise ValueError("a request mix needs at least one request")
        kept = counts.most_common(limit or None)
        total = float(sum(n for _, n in kept))
        return cls(
            np.array([s for (s, _), _ in kept], dtype=np.int64),
            np.array([m for (_, m), _ in kept], dtype=np.float64),
            np.array([n / total for _, n in kept], dtype=np.float64),
        )


@dataclass(frozen=True)
class _Offer:
    """What each device row offers, and to whom (see the module's rules). Shapes: each [N]."""

    free: NDArray[np.float64]  # milli-devices free, as the row offers them
    memory: NDArray[np.float64]  # GB free on the row (a partition: its own; a shareable: unreserved)
    shareable: NDArray[np.bool_]
    partition: NDArray[np.bool_]
    capacity: NDArray[np.float64]
    empty: NDArray[np.bool_]  # a shareable row holding nothing (a whole request may take it)
    parent_whole: NDArray[np.bool_]  # a partition whose parent could be taken whole
    parent_memory: NDArray[np.float64]  # a partition's parent's free memory (GB)


def _offers(graph: InfraGraph, rows: Rows) -> _Offer:
    d = graph.devices
    ok = d.alive[rows] & (d.health[rows] != ev.HEALTH_FAILED)
    shareable = d.sharing[rows] > 0
    partition = d.partition[rows]
    capacity = d.share_capacity[rows].astype(np.float64)
    used = d.share_used[rows].astype(np.float64)
    memory = np.maximum(d.memory_gb[rows] - d.reserved_gb[rows], 0.0)
    parent = np.where(partition, d.parent[rows], -1)
    known = parent >= 0
    safe = np.maximum(parent, 0)
    parent_idle = ~known | ((d.n_tasks[safe] == 0) & d.alive[safe])
    parent_whole = known & parent_idle & (d.busy_partitions[safe] == 0) & (d.health[safe] != ev.HEALTH_FAILED)
    parent_memory = np.where(known, np.maximum(d.memory_gb[safe] - d.reserved_gb[safe], 0.0), 0.0)
    has_partitions = _partition_counts(graph)[rows] > 0
    free = np.where(
        shareable,
        np.maximum(capacity - used, 0.0),
        np.where(
            partition,
            np.where((used == 0) & parent_idle, capacity, 0.0),
            np.where((d.n_tasks[rows] == 0) & ~has_partitions, float(WHOLE_SHARE), 0.0),
        ),
    )
    return _Offer(
        free * ok, memory, shareable, partition, capacity, shareable & (used == 0), parent_whole, parent_memory
    )


def _partition_counts(graph: InfraGraph) -> NDArray[np.int64]:
    """Live partitions per parent row. Shape [capacity]."""
    d = graph.devices
    live = d.alive & d.partition & (d.parent >= 0)
    return np.bincount(d.parent[live], minlength=d.capacity).astype(np.int64)


def _fragments(offer: _Offer, mix: RequestMix) -> NDArray[np.float64]:
    """Each row's expected fragment (milli-devices) over ``mix``. [N] -> [N]."""
    share = mix.share_milli[None, :]
    need = mix.memory_gb[None, :]
    whole = share == 0
    free = offer.free[:, None]
    memory_fits = offer.memory[:, None] >= need
    on_shareable = np.where(whole, offer.empty[:, None], free >= share) & memory_fits
    on_partition = np.where(
        whole, offer.parent_whole[:, None] & (offer.parent_memory[:, None] >= need), offer.capacity[:, None] >= share
    ) & (whole | memory_fits)
    on_exclusive = whole & memory_fits
    usable = np.where(
        offer.shareable[:, None], on_shareable, np.where(offer.partition[:, None], on_partition, on_exclusive)
    )
    fragments: NDArray[np.float64] = (free * ~usable) @ mix.weight
    return fragments


def fragmentation_milli(graph: InfraGraph, mix: RequestMix) -> float:
    """The cluster's expected fragmentation F over ``mix`` (milli-devices; / 1000: GPU-equivalents)."""
    rows = graph.devices.live_rows()
    return float(_fragments(_offers(graph, rows), mix).sum()) if len(rows) else 0.0


def free_milli(graph: InfraGraph) -> float:
    """Capacity no task holds (milli-devices), each physical device counted once (as in F)."""
    rows = graph.devices.live_rows()
    return float(_offers(graph, rows).free.sum()) if len(rows) else 0.0


def held_mix(graph: InfraGraph, limit: int = MIX_WINDOW) -> RequestMix | None:
    """The mix of the requests of the newest ``limit`` tasks ``graph`` holds (pending, placed,
    running, and ended ones not forgotten yet): the daemon's view of the typical request; None
    when it holds none."""
    newest = itertools.islice(reversed(graph.tasks.values()), limit)
    requests = [request_type(task.spec) for task in newest]
    return RequestMix.of(requests, MIX_TYPES) if requests else None


def cluster_fragmentation_gpus(graph: InfraGraph) -> float | None:
    """The expected fragmentation (GPU-equivalents) of ``graph`` against :func:`held_mix`; None
    without shared devices (nothing fragments) or tasks (no request to measure against)."""
    if not graph.shared_devices:
        return None
    mix = held_mix(graph)
    return fragmentation_milli(graph, mix) / WHOLE_SHARE if mix is not None else None


def fragmentation_delta(graph: InfraGraph, spec: ev.TaskSpec, rows: Rows, mix: RequestMix) -> NDArray[np.float64]:
    """How much F (milli-devices) would change if ``spec`` took each of ``rows`` (one member of its
    gang there). The row itself changes, and so do its partition siblings (they can no longer be
    taken with their parent whole) or, for a parent taken whole, its partitions. [N] -> [N]."""
    d = graph.devices
    before = _offers(graph, rows)
    fragments_before = _fragments(before, mix)
    share = int(spec.device_share_milli)
    charge = np.where(before.partition, before.capacity, float(share) if share else before.capacity)
    after = _Offer(
        free=np.where(before.shareable, np.maximum(before.free - charge, 0.0), 0.0),
        memory=np.maximum(before.memory - spec.memory_per_device_gb, 0.0),
        shareable=before.shareable,
        partition=before.partition,
        capacity=before.capacity,
        empty=np.zeros(len(rows), dtype=np.bool_),
        parent_whole=np.zeros(len(rows), dtype=np.bool_),
        parent_memory=before.parent_memory,
    )
    delta = _fragments(after, mix) - fragments_before
    partitions = _partition_counts(graph)
    if not partitions.any():
        return delta
    # What the row's physical device's partitions offer, before: summed per parent row.
    live = d.live_rows()
    everything = _offers(graph, live)
    on_partition = live[d.partition[live] & (d.parent[live] >= 0)]
    index = np.searchsorted(live, on_partition)
    parents = d.parent[on_partition]
    free_by_parent = np.bincount(parents, weights=everything.free[index], minlength=d.capacity)
    fragment_by_parent = np.bincount(parents, weights=_fragments(everything, mix)[index], minlength=d.capacity)
    # A parent taken whole: its partitions offer nothing any more.
    whole_parent = ~before.partition & ~before.shareable & (partitions[rows] > 0)
    delta -= np.where(whole_parent, fragment_by_parent[rows], 0.0)
    # A partition taken: its siblings lose whole-device requests (their parent is no longer whole).
    parent = np.maximum(d.parent[rows], 0)
    siblings_free = np.where(before.partition & before.parent_whole, free_by_parent[parent] - before.free, 0.0)
    whole_usable = (mix.share_milli[None, :] == 0) & (before.parent_memory[:, None] >= mix.memory_gb[None, :])
    delta += siblings_free * (whole_usable.astype(np.float64) @ mix.weight)
    return delta


class FragmentationGradient(Policy):
    """FGD-style placement: each task where it grows the expected fragmentation least (see the module)."""

    name = "fgd"

    def __init__(self, weights: ObjectiveWeights | None = None, profiles: DeviceProfiles | None = None) -> None:
        self.greedy = HeteroGreedy(weights, profiles)
        self._seen: deque[tuple[int, float]] = deque(maxlen=MIX_WINDOW)

    @property
    def estimates(self) -> DeviceProfiles:
        return self.greedy.profiles

    def mix(self, spec: ev.TaskSpec) -> RequestMix:
        """The requests placed so far (the last :data:`MIX_WINDOW`), or ``spec`` alone before any."""
        seen = list(self._seen) or [request_type(spec)]
        return RequestMix.of(seen, MIX_TYPES)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        delta_gpus = fragmentation_delta(graph, spec, rows, self.mix(spec)) / WHOLE_SHARE
        finish = self.greedy.score(spec, graph, rows)
        # The tie-break stays below TIE_GPUS whatever the finish: x / (1 + |x|) is in (-1, 1).
        scores: Scores = -np.round(delta_gpus / TIE_GPUS) * TIE_GPUS + TIE_GPUS / 4 * finish / (1 + np.abs(finish))
        return scores

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self._seen.append(request_type(spec))

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.greedy.finished(spec, graph, rows, ran_s)


def request_type(spec: ev.TaskSpec) -> tuple[int, float]:
    """A request's type: its share (0: whole devices) and its memory per device rounded up to 1 GB."""
    return int(spec.device_share_milli), float(math.ceil(spec.memory_per_device_gb))


__all__ = [
    "FragmentationGradient",
    "RequestMix",
    "cluster_fragmentation_gpus",
    "fragmentation_delta",
    "fragmentation_milli",
    "free_milli",
    "held_mix",
    "request_type",
]
