"""Placement policies behind one interface.

A policy never sees an infeasible device: the graph's hard-constraint filter
(``InfraGraph.feasible_rows``) removes every device that breaks one (health, kind, model, free
memory) before any policy ranks what is left. A policy scores candidate device rows (higher is
better); :func:`choose_gang` then picks the gang all or nothing, preferring one host, then one
rack, among the best-scored devices.

Baselines (``make_policy`` names): ``random`` (seeded), ``round-robin``, ``least-loaded``,
``best-fit`` (Tetris-style packing), ``hetero-greedy`` (earliest estimated finish from the
device profiles, Gavel-style throughput awareness) and ``heft`` (HEFT's upward ranks order a
DAG's tasks; each goes where it would finish first, counting the transfer of its inputs from
where its dependencies ran). The objective weights (completion time, utilization, energy) steer
``hetero-greedy`` and ``heft``; the simpler baselines ignore them by design.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.config import ModelSettings
from hlb.daemon.decide.gnn.features import device_share
from hlb.daemon.decide.heft import upward_ranks
from hlb.daemon.state.graph import HOST_NODE, SWITCH_NODE, InfraGraph, Occupancy, Rows, Task
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles
from hlb.v1 import events_pb2 as ev

Scores = NDArray[np.float64]

POLICY_NAMES = ("random", "round-robin", "least-loaded", "best-fit", "hetero-greedy", "heft")

# Transfer bandwidth (Gbit/s) by locality tier when the graph has no link that says better.
DEFAULT_INTRA_HOST_GBPS = 256.0  # PCIe 4.0 x16
DEFAULT_INTER_HOST_GBPS = 100.0  # one 100 Gb/s NIC
# Peak power of the reference device (a V100 SXM2); also assumed for a device without a figure.
REFERENCE_POWER_W = 300.0
# A gang is chosen among the best ``max(GANG_POOL_FACTOR * gang, GANG_POOL_MIN)`` scored devices.
GANG_POOL_FACTOR = 4
GANG_POOL_MIN = 64


@dataclass(frozen=True)
class ObjectiveWeights:
    """How much each objective counts; only their ratios matter. All >= 0."""

    completion_time: float = 1.0
    utilization: float = 0.0
    energy: float = 0.0

    @classmethod
    def of(cls, value: ObjectiveWeights | Mapping[str, float] | None) -> ObjectiveWeights:
        if value is None:
            return cls()
        if isinstance(value, ObjectiveWeights):
            return value
        unknown = set(value) - {"completion_time", "utilization", "energy"}
        if unknown:
            raise ValueError(f"unknown objective weights {sorted(unknown)}")
        weights = cls(**{k: float(v) for k, v in value.items()})
        if min(weights.completion_time, weights.utilization, weights.energy) < 0:
            raise ValueError("objective weights must be >= 0")
        return weights


class BatchChooser(Protocol):
    """Decisions for the tasks of one shape within one batch (one hold of the daemon's lock), equal
    to those the policy would make one task at a time."""

    def choose(self, spec: ev.TaskSpec) -> tuple[Rows, Rows, float] | None:
        """(feasible rows, gang, mean score) now; None: decide this task without the chooser."""

    def bound(self, rows: Sequence[int], own: bool) -> None:
        """The batch bound ``rows``; ``own``: to the task this chooser answered last."""


@dataclass(frozen=True)
class Wait:
    """A policy's choice to leave a task queued for a busy device where it would finish sooner than
    on the free device it could take now: ``row`` is expected free in ``wait_s``, the task would run
    ``runtime_s`` there; ``free_finish_s`` is the estimated finish on the free device it declines
    (for a gang: on the devices it declines, ``row`` the last of the host's devices it waits for)."""

    row: int
    device_id: str
    wait_s: float
    runtime_s: float
    free_finish_s: float
    # A service waiting for a device that meets its latency SLO: the estimated request latency (ms)
    # on the free device it declines; 0 for a task waiting to finish sooner.
    free_latency_ms: float = 0.0
    # A gang waiting for this many devices of one host (``row`` the last of them expected free).
    devices: int = 1

    @property
    def reason(self) -> str:
        """Why the task is pending, in words (it starts with "waiting for", as a dependency's does)."""
        if self.free_latency_ms > 0:
            now = (
                "a device free now would be saturated"
                if math.isinf(self.free_latency_ms)
                else f"estimated {self.free_latency_ms:,.1f} ms on a device free now"
            )
            return (
                f"waiting for device {self.device_id}: expected free in {self.wait_s:,.0f} s, where it would meet"
                f" its latency SLO ({now})"
            )
        if self.devices > 1:
            return (
                f"waiting for {self.devices} devices on the host of {self.device_id}, the last expected free in"
                f" {self.wait_s:,.0f} s, where it would finish in {self.wait_s + self.runtime_s:,.0f} s against"
                f" {self.free_finish_s:,.0f} s on the devices free now"
            )
        return (
            f"waiting for device {self.device_id}: expected free in {self.wait_s:,.0f} s, where it would finish"
            f" in {self.wait_s + self.runtime_s:,.0f} s against {self.free_finish_s:,.0f} s on a device free now"
        )


class Policy:
    """Ranks feasible devices for a task. Subclasses implement :meth:`score`.

    ``placed`` is told about every binding (stateful policies such as round-robin advance on
    it, never in ``score``, so dry runs and explanations change nothing); ``rank`` may order
    the queue within one priority (HEFT's upward ranks), None keeps arrival order.
    """

    name = "policy"
    # True when a row's score depends only on that row and the task (not on the other candidates
    # or the policy's own state): a batch may then rescore only the rows its placements changed.
    row_local = False
    # True when binding a task to a row never raises that row's score for any task (more tasks and
    # reserved memory only make a device look worse): a batch may then treat a score computed
    # before the binding as an upper bound and rescore lazily.
    binding_lowers_scores = False

    @property
    def waits(self) -> bool:
        """True when the policy may leave a task queued for a busy device (:meth:`wait_for`); the
        scheduler then keeps the expected end of every placed task (``free_at_ms``) for it."""
        return False

    @property
    def degraded(self) -> str:
        """Why this policy cannot decide as configured now (a fallback decides); empty when it can."""
        return ""

    @property
    def model_version(self) -> str:
        """Version of the learned model deciding; empty for a policy without one."""
        return ""

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        """Scores of the device ``rows`` for ``spec``. Shapes: rows [C] -> scores [C], float64."""
        raise NotImplementedError

    def batch_scorer(self, spec: ev.TaskSpec, graph: InfraGraph) -> Callable[[Rows], Scores]:
        """``score`` for ``spec`` while the inventory stays as it is now (one batch, under the lock):
        a policy may compute what depends only on the devices once. Same scores as ``score``."""
        return lambda rows: self.score(spec, graph, rows)

    def shortlist(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows) -> Rows:
        """The feasible rows this policy ranks for ``spec`` (ascending): all of them, unless the
        policy narrows them cheaply first (the GNN's two-stage ranking). Explain shows these."""
        return feasible

    def task_key(self, spec: ev.TaskSpec) -> tuple[object, ...]:
        """What else in ``spec`` than its shape (kind, size, memory, work, allowed and preferred
        devices) the scores depend on, so that a batch reuses scores only among equal keys."""
        return ()

    def batch_chooser(self, spec: ev.TaskSpec, graph: InfraGraph) -> BatchChooser | None:
        """A policy's own way to decide the tasks of ``spec``'s shape through one batch, or None
        (the scheduler's: cached scores for a ``row_local`` policy, else each decision alone)."""
        return None

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        """The task was bound to ``rows``."""

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        """A busy device ``spec`` should wait for instead of taking ``gang`` (free now, scored
        ``score``), or None to take it. ``queued_s``: seconds of run time of other tasks already
        waiting for a row. Only a policy that can wait overrides this (the GNN's); the baselines
        take what fits now."""
        return None

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        """Queue order within a priority, higher first. Shapes: [len(tasks)]; None: arrival order."""
        return None

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
    ) -> tuple[Rows, float]:
        """The gang for ``spec`` among ``feasible`` rows (``scores``: their scores, when known) and its
        mean score; empty when too few fit."""
        return choose_gang(self, spec, graph, feasible, scores)


class RandomPolicy(Policy):
    """Uniformly random feasible devices, reproducible from the seed."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        return self.rng.random(len(rows))


class RoundRobin(Policy):
    """Devices in turn, by row: the first feasible row after the last one placed on scores highest."""

    name = "round-robin"

    def __init__(self) -> None:
        self.last_row = -1

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        span = max(graph.devices.capacity, 1)
        distance = (rows - self.last_row - 1) % span
        return -distance.astype(np.float64)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        if len(rows):
            self.last_row = int(rows[-1])


class LeastLoaded(Policy):
    """Prefer the devices with the lowest load (utilization or reserved memory share).

    Ties go to the device with more free memory (a nanounit per GB, far below any load step).
    """

    name = "least-loaded"
    row_local = True
    binding_lowers_scores = True  # load rises and free memory falls

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        free = graph.free_memory_gb(rows)
        scores: Scores = 1.0 - graph.load(rows) + 1e-9 * free
        return scores


class BestFit(Policy):
    """Tetris-style packing over (memory, compute).

    Demand ``d = (memory_per_device / memory, 1)`` and free capacity ``f = (free memory /
    memory, 1 - load)`` are fractions of the device. The score is the cosine alignment of ``d``
    and ``f`` minus the capacity left over after placing, ``|f - d|_1 / 2``: the task goes where
    its shape matches what is free and fills it most, keeping whole devices free for big tasks.
    """

    name = "best-fit"
    row_local = True

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        memory = np.maximum(graph.devices.memory_gb[rows], 1e-9)
        demand = np.stack([np.minimum(spec.memory_per_device_gb / memory, 1.0), np.ones(len(rows))], axis=1)
        free = np.stack([np.clip(graph.free_memory_gb(rows) / memory, 0.0, 1.0), 1.0 - graph.load(rows)], axis=1)
        norms = np.linalg.norm(demand, axis=1) * np.linalg.norm(free, axis=1)
        alignment = np.divide((demand * free).sum(axis=1), norms, out=np.zeros(len(rows)), where=norms > 0)
        leftover = np.abs(free - demand).sum(axis=1) / 2.0
        scores: Scores = alignment - leftover
        return scores


class HeteroGreedy(Policy):
    """Earliest estimated finish on the feasible devices (heterogeneity-aware greedy).

    Estimated finish = input ready time (HEFT subclass only) + run time from the device's
    profile for the task's workload class, stretched by the share of the device the task would
    get (:func:`device_share`). With the weights, the score is

        - w_ct * finish / work_ref_s - w_e * energy / (work_ref_s * REFERENCE_POWER_W) + w_u * (1 - load)

    where energy is the run time at the device's peak power (the estimate of what the task adds).
    Both are relative to the task on an idle reference device, so a device's score does not depend
    on which other candidates are scored with it (an external scheduler may send any subset).
    """

    name = "hetero-greedy"
    row_local = True
    # The share a new task gets falls with the tasks placed there and the load rises: with weights
    # >= 0 (set in __init__) every term can only fall.

    def __init__(self, weights: ObjectiveWeights | None = None, profiles: DeviceProfiles | None = None) -> None:
        self.weights = weights or ObjectiveWeights()
        self.profiles = profiles or default_profiles()
        w = self.weights
        self.binding_lowers_scores = min(w.completion_time, w.utilization, w.energy) >= 0

    def ready_s(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        """When the task's inputs would be on each row, seconds from now. [N] -> [N]."""
        return np.zeros(len(rows))

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        return self._score(spec, graph, rows, self.profiles.runtime_s(graph, rows, spec))

    def score_with(
        self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, runtime: NDArray[np.float64], occupancy: Occupancy
    ) -> Scores:
        """``score`` with the run times given and the rows' tasks and reservations as ``occupancy``
        says (a row may appear more than once). Shapes: rows, runtime [N] -> [N]."""
        return self._score(spec, graph, rows, runtime, occupancy)

    def batch_scorer(self, spec: ev.TaskSpec, graph: InfraGraph) -> Callable[[Rows], Scores]:
        """The run times (a device's model and peak) are computed once for every device row; a task
        without dependencies has its inputs ready everywhere (``ready_s`` 0), so that is not added."""
        runtime = self.profiles.runtime_s(graph, np.arange(graph.devices.capacity, dtype=np.int64), spec)
        ready = bool(spec.dependencies)
        return lambda rows: self._score(spec, graph, rows, runtime[rows], ready=ready)

    def _score(
        self,
        spec: ev.TaskSpec,
        graph: InfraGraph,
        rows: Rows,
        runtime: NDArray[np.float64],
        occupancy: Occupancy | None = None,
        ready: bool = True,
    ) -> Scores:
        w = self.weights
        work = spec.work_ref_s if spec.work_ref_s > 0 else 1.0
        finish = runtime / device_share(graph, rows, occupancy)
        if ready:
            finish = self.ready_s(spec, graph, rows) + finish
        scores: Scores = finish * (-w.completion_time / work)
        if w.energy:
            power = graph.devices.peak_power_w[rows]
            energy = runtime * np.where(power > 0, power, REFERENCE_POWER_W)
            scores -= w.energy * energy / (work * REFERENCE_POWER_W)
        if w.utilization:
            scores += w.utilization * (1.0 - graph.load(rows, occupancy))
        return scores


class Heft(HeteroGreedy):
    """HEFT online: upward ranks over the known DAG order the queue within a priority, and each
    task goes to the device where it would finish first, counting the transfer of each
    dependency's output (``transfer_gb``) from the devices the dependency ran on.

    Ranks use the mean run time over the device models present (HEFT's ``w̄``) and the mean
    transfer time at the inter-host bandwidth (``c̄``).
    """

    name = "heft"

    def ready_s(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        ready = np.zeros(len(rows))
        for dep in spec.dependencies:
            upstream = graph.tasks.get(dep.task_id)
            if upstream is None or not upstream.device_rows or dep.transfer_gb <= 0:
                continue
            ready = np.maximum(ready, transfer_s(graph, upstream.device_rows[0], rows, dep.transfer_gb))
        return ready

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        """Upward ranks of the queued ``tasks``. A queued task's successors are queued too (none can
        start before it finishes), so the DAG is the queue itself. Shapes: -> [len(tasks)]."""
        if not tasks:
            return None
        index = {t.spec.id: i for i, t in enumerate(tasks)}
        live = graph.devices.live_rows()
        models = np.unique(graph.devices.model[live])
        # One representative row per model present; peak TFLOPS matter only for unlisted models.
        reps = np.array([live[np.flatnonzero(graph.devices.model[live] == m)[0]] for m in models], dtype=np.int64)
        costs = np.ones((len(tasks), max(1, len(reps))))
        if len(reps):
            for i, task in enumerate(tasks):
                costs[i] = self.profiles.runtime_s(graph, reps, task.spec)
        edges = [
            (index[dep.task_id], i, dep.transfer_gb * 8.0 / DEFAULT_INTER_HOST_GBPS)
            for i, task in enumerate(tasks)
            for dep in task.spec.dependencies
            if dep.task_id in index
        ]
        try:
            return upward_ranks(costs, edges, lambda data, p, q: data)
        except ValueError:  # a cycle among submitted tasks: arrival order
            return None


def host_uplink_gbps(graph: InfraGraph, host: int) -> float:
    """Bandwidth from a host to its network: its best link to a switch, else the default."""
    t = graph.links
    up = (t.src_type == HOST_NODE) & (t.src == host) & (t.dst_type == SWITCH_NODE)
    down = (t.dst_type == HOST_NODE) & (t.dst == host) & (t.src_type == SWITCH_NODE)
    touches = t.alive & (up | down)
    best = float(t.bandwidth_gbps[touches].max(initial=0.0))
    return best if best > 0 else DEFAULT_INTER_HOST_GBPS


def transfer_s(graph: InfraGraph, src_row: int, rows: Rows, gb: float) -> NDArray[np.float64]:
    """Seconds to move ``gb`` gigabytes from device ``src_row`` to each of ``rows``. [N] -> [N].

    0 on the same device; at the intra-host bandwidth on the same host; else at the smaller of
    the two hosts' uplinks. Links that name the devices or hosts refine the defaults.
    """
    d = graph.devices
    out = np.zeros(len(rows))
    if not (0 <= src_row < d.capacity and d.alive[src_row]):  # its device is gone: assume another host
        return out + gb * 8.0 / DEFAULT_INTER_HOST_GBPS
    src_host = int(d.host[src_row])
    hosts = d.host[rows]
    same_host = (hosts == src_host) & (rows != src_row)
    out[same_host] = gb * 8.0 / DEFAULT_INTRA_HOST_GBPS
    other = hosts != src_host
    if other.any():
        src_up = host_uplink_gbps(graph, src_host)
        for host in np.unique(hosts[other]):
            bandwidth = min(src_up, host_uplink_gbps(graph, int(host)))
            out[other & (hosts == host)] = gb * 8.0 / bandwidth
    return out


def choose_gang(
    policy: Policy, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
) -> tuple[Rows, float]:
    """The gang for ``spec`` and its mean score; empty when fewer than the gang size are feasible.

    One device: the best-scored. A gang of ``g``: among the best ``max(4g, 64)`` scored devices,
    the best ``g`` on one host if a host has that many, else on one rack, else the best ``g``
    anywhere (ties keep row order, so decisions are reproducible).
    """
    gang = max(1, spec.num_devices)
    if len(feasible) < gang:
        return np.empty(0, dtype=np.int64), 0.0
    if scores is None:
        scores = policy.score(spec, graph, feasible)
    if gang == 1:
        first = int(np.argmax(scores))  # the first of equal best scores: row order breaks ties
        return feasible[first : first + 1], float(scores[first])
    order = np.argsort(-scores, kind="stable")
    pool = order[: max(GANG_POOL_FACTOR * gang, GANG_POOL_MIN)]
    hosts = graph.devices.host[feasible[pool]]
    racks = graph.hosts.rack[hosts]
    for domains in (hosts, np.where(racks >= 0, racks, -2 - hosts)):
        chosen = _best_domain(domains, scores[pool], gang)
        if chosen is not None:
            best = pool[chosen]
            return feasible[best], float(scores[best].mean())
    best = order[:gang]
    return feasible[best], float(scores[best].mean())


def _best_domain(domains: NDArray[Any], scores: Scores, gang: int) -> NDArray[np.int64] | None:
    """Indices (into the pool, best first) of the best ``gang`` members of the domain whose best
    ``gang`` have the highest mean score; None when no domain has ``gang`` members."""
    values, counts = np.unique(domains, return_counts=True)
    best: tuple[float, NDArray[np.int64]] | None = None
    for value in values[counts >= gang]:
        members = np.flatnonzero(domains == value)[:gang]  # the pool is in score order
        mean = float(scores[members].mean())
        if best is None or mean > best[0]:
            best = (mean, members)
    return None if best is None else best[1]


def make_policy(
    name: str,
    weights: ObjectiveWeights | Mapping[str, float] | None = None,
    seed: int = 0,
    model: ModelSettings | None = None,
) -> Policy:
    """The policy called ``name`` (one of ``POLICY_NAMES``, or ``gnn``); ``ValueError`` for any other.

    ``gnn`` is :class:`hlb.daemon.decide.gnn.policy.GnnPolicy` in sync mode (it re-encodes the graph it is
    given when that changed: the simulator's and ``hlb eval``'s use) with the ``model`` settings
    (default: the model shipped in the package); it decides with hetero-greedy while the model
    cannot be used.
    """
    w = ObjectiveWeights.of(weights)
    if name == "gnn":
        from hlb.daemon.config import ModelRefreshSettings
        from hlb.daemon.decide.gnn.policy import GnnPolicy  # it builds on this module

        # Without settings: re-encode after every change, so each decision sees the graph as it is.
        exact = ModelSettings(refresh=ModelRefreshSettings(mode="sync", min_changed_rows=1))
        return GnnPolicy(model or exact, w, mode="sync")
    if name == "random":
        return RandomPolicy(seed)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "best-fit":
        return BestFit()
    if name == "hetero-greedy":
        return HeteroGreedy(w)
    if name == "heft":
        return Heft(w)
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join((*POLICY_NAMES, 'gnn'))}")


__all__ = [
    "POLICY_NAMES",
    "BatchChooser",
    "BestFit",
    "Heft",
    "HeteroGreedy",
    "LeastLoaded",
    "ObjectiveWeights",
    "Policy",
    "RandomPolicy",
    "RoundRobin",
    "Wait",
    "choose_gang",
    "make_policy",
]
