"""The scorers: rank a task's feasible devices, higher is better. Each is also a policy on its own.

A scorer never sees an infeasible device: the graph's hard-constraint filter
(``InfraGraph.feasible_rows``) removes every device that breaks one (health, kind, model, free
memory) before any scorer ranks what is left.

Baselines (preset names, ``hlb.daemon.decide.presets``): ``random`` (seeded), ``round-robin``,
``least-loaded``, ``best-fit`` (Tetris-style packing), ``hetero-greedy`` (earliest estimated finish
from the device profiles, Gavel-style throughput awareness) and ``heft`` (HEFT's upward ranks order
a DAG's tasks; each goes where it would finish first, counting the transfer of its inputs from
where its dependencies ran). The objective weights (completion time, utilization, energy) steer
``hetero-greedy`` and ``heft``; the simpler baselines ignore them by design. Hetero-greedy also
scores the busy devices a task could wait for (:meth:`HeteroGreedy.score_waits`), so the rules
of ``hlb.daemon.decide.rules`` can run on it (the ``rules`` preset).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.framework import ObjectiveWeights, Policy, Scores, WaitOptions
from hlb.daemon.decide.heft import upward_ranks
from hlb.daemon.state.checks import WHOLE_SHARE
from hlb.daemon.state.feasibility import Occupancy, share_charge
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles
from hlb.daemon.state.tables import HOST_NODE, SWITCH_NODE, Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

# Transfer bandwidth (Gbit/s) by locality tier when the graph has no link that says better.
DEFAULT_INTRA_HOST_GBPS = 256.0  # PCIe 4.0 x16
DEFAULT_INTER_HOST_GBPS = 100.0  # one 100 Gb/s NIC
# Peak power of the reference device (a V100 SXM2); also assumed for a device without a figure.
REFERENCE_POWER_W = 300.0


def device_share(
    graph: InfraGraph, rows: Rows, occupancy: Occupancy | None = None, share_milli: int = 0
) -> NDArray[np.float64]:
    """Share of each device a new task would get: processor sharing with the ``n`` tasks hlb placed
    there (``1 / (n + 1)``), or what measured load leaves free when that is less. ``occupancy``:
    instead of the rows' own. A task that asks for ``share_milli`` of a device gets that share (all
    of a partition: its compute share), less where time slicing overcommits the device (the shares
    held there with it above 1000; docs/fractional.md). [N] -> [N] in (0, 1]."""
    d = graph.devices
    if share_milli:
        charge = share_charge(d, share_milli, rows).astype(np.float64)
        used = d.share_used[rows] if occupancy is None else occupancy.share_used
        overcommit = np.maximum(1.0, (used + charge) / WHOLE_SHARE)
        fraction: NDArray[np.float64] = np.clip(charge / WHOLE_SHARE / overcommit, 1e-3, 1.0)
        return fraction
    placed = 1.0 / (1.0 + (d.n_tasks[rows] if occupancy is None else occupancy.n_tasks))
    measured = np.maximum(1.0 - d.utilization[rows], 0.05)
    share: NDArray[np.float64] = np.minimum(placed, measured)
    return share


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

    @property
    def estimates(self) -> DeviceProfiles:
        return self.profiles

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.profiles.observe(spec, graph, rows, ran_s)  # profiles that learn (the rules-table preset) learn

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

    def score_waits(self, spec: ev.TaskSpec, graph: InfraGraph, waits: WaitOptions) -> Scores:
        """The score of each busy device once free: finish = the wait plus the run time there (the
        whole device, nothing else on it), energy at its peak power, load 0. [B] -> [B]."""
        w = self.weights
        work = spec.work_ref_s if spec.work_ref_s > 0 else 1.0
        scores: Scores = (waits.wait_s + waits.runtime_s) * (-w.completion_time / work)
        if w.energy:
            power = graph.devices.peak_power_w[waits.rows]
            energy = waits.runtime_s * np.where(power > 0, power, REFERENCE_POWER_W)
            scores -= w.energy * energy / (work * REFERENCE_POWER_W)
        if w.utilization:
            scores += w.utilization
        return scores

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
        finish = runtime / device_share(graph, rows, occupancy, spec.device_share_milli)
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


__all__ = [
    "BestFit",
    "Heft",
    "HeteroGreedy",
    "LeastLoaded",
    "RandomPolicy",
    "RoundRobin",
    "device_share",
    "transfer_s",
]
