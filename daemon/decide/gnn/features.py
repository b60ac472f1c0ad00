"""The GNN's inputs, built from an :class:`~hlb.daemon.state.graph.InfraGraph` with numpy only.

Two consumers read the same arrays: the daemon, which feeds them to the exported ONNX graphs
through onnxruntime, and ``export/``, which trains the torch model on them. Nothing here imports
torch.

Longer than hlb's modules usually are, on purpose: each feature's schema entry (name, transform,
scale) and the code that computes it stay in one file, in input order, so that a change to one is
seen beside the other, and :data:`FEATURE_SCHEMA_VERSION` versions them together.

Every feature is a physical quantity with a documented fixed scale (:data:`DEVICE_FEATURES` and
friends list name, transform and scale in input order), never a one-hot device model name, so a
model trained on some accelerators and cluster sizes reads others the same way. Transforms:

- ``linear``: ``x / scale`` (shares, utilizations, flags);
- ``log1p``: ``log1p(max(x, 0) / scale)`` for heavy-tailed quantities (memory, work, power);
- ``symlog``: ``sign(x) * log1p(|x| / scale)`` for signed ones (priority, deadline slack).

Every value is finite and clipped to ``[-CLIP, CLIP]``.

Nodes are *packed*: the live rows of each table in ascending order become positions 0..N-1
(``EncoderInputs.device_rows[i]`` is the graph row of device position ``i``). Edges are padded
neighbour lists, gathered by the model rather than scattered (docs/design.md §4): for each
destination node a row of ``K`` source positions (``index``, int64 [N, K]) and a mask (float32
[N, K], 1 for a real neighbour). A padding slot holds the source count ``N_src``, which the model
maps to an all-zero row it appends to the source embeddings, so every index is valid even when the
source set is empty. ``K = max(1, largest degree)``. Duplicate edges are kept (each counts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.observed import workload_family
from hlb.daemon.state.profiles import TASK_KIND_NAMES as PROFILE_TASK_KINDS
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import DEVICE_NODE, HOST_NODE, SWITCH_NODE, Rows, TaskTable
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

FEATURE_SCHEMA_VERSION = 4  # 3: speed ratios from shape and prior features; 4: spread gangs per host
CLIP = 10.0

# Peak dense throughput of the reference accelerator (V100-SXM2, FP16 tensor cores), TFLOPS.
# ``TaskSpec.work_ref_s`` is seconds on that device, so a device's speed estimate is its
# peak_tflops over this when no measured profile is given.
REFERENCE_PEAK_TFLOPS = 125.0

# The encoder reads every placed and running task (they shape their devices' embeddings) and at
# most this many pending ones: beyond it an evenly spaced sample of the pending rows, so that the
# context's mean pending-task embedding is still estimated from the whole queue, and its pending
# count reads this many. Above the queues the model is trained on (a training simulation has at
# most 600 tasks); without a bound, a refresh's time and memory grew with the queue (1.4 s more at
# 100,000 queued on 1,000 devices; the queue may hold scheduler.max_pending, a million by default).
PENDING_ENCODED_MAX = 1024
# The widest neighbour list of a task's edges (its devices, its parents, its children, a device's
# tasks). A padded list is as wide as its largest row, for every row: one gang of 4,096 devices,
# or one device holding a thousand small shares, made every refresh take seconds and gigabytes
# (3.7 to 18.9 s and 13 GB at 10,000 devices with 1,000 tasks on one device). A longer row keeps
# this many, evenly spaced. The model aggregates by mean and max, which a sample estimates, and
# the counts stay features. Training never reaches it: gangs of at most 8 devices, at most 9
# shares on a device, a few parents or children a task.
TASK_NEIGHBOURS_MAX = 16
# The dependencies of one task looked up for its parent edges (evenly spaced in its list beyond
# this): four times the parents its list keeps, so that some are live when most have finished.
DEPENDENCIES_READ = 4 * TASK_NEIGHBOURS_MAX

Transform = Literal["linear", "log1p", "symlog"]
Matrix = NDArray[np.float32]
Index = NDArray[np.int64]


@dataclass(frozen=True)
class Feature:
    """One input column: its name, how the raw value is scaled, and the raw value's unit."""

    name: str
    transform: Transform
    scale: float
    unit: str

    def as_dict(self) -> dict[str, str | float]:
        return {"name": self.name, "transform": self.transform, "scale": self.scale, "unit": self.unit}


def _f(name: str, transform: Transform, scale: float, unit: str) -> Feature:
    return Feature(name, transform, scale, unit)


DEVICE_FEATURES: tuple[Feature, ...] = (
    _f("peak_tflops", "log1p", 100.0, "TFLOPS"),
    _f("memory_gb", "log1p", 16.0, "GB"),
    _f("free_memory_gb", "log1p", 16.0, "GB"),
    _f("free_memory_share", "linear", 1.0, "fraction"),
    _f("reserved_share", "linear", 1.0, "fraction of memory reserved by hlb"),
    _f("utilization", "linear", 1.0, "fraction"),
    _f("load", "linear", 1.0, "max(utilization, reserved share)"),
    _f("power_w", "log1p", 300.0, "W"),
    _f("idle_power_w", "log1p", 300.0, "W"),
    _f("peak_power_w", "log1p", 300.0, "W"),
    _f("power_share", "linear", 1.0, "power_w / peak_power_w"),
    _f("tflops_per_w", "log1p", 0.5, "TFLOPS/W at peak"),
    _f("temperature_c", "linear", 100.0, "degC"),
    _f("healthy", "linear", 1.0, "flag"),
    _f("degraded", "linear", 1.0, "flag"),
    _f("failed", "linear", 1.0, "flag"),
    _f("n_tasks", "log1p", 1.0, "tasks placed or running"),
    _f("link_gbps", "log1p", 100.0, "GB/s of links touching the device (NVLink, PCIe)"),
    _f("kind_gpu", "linear", 1.0, "flag"),
    _f("kind_tpu", "linear", 1.0, "flag"),
    _f("kind_fpga", "linear", 1.0, "flag"),
    _f("kind_asic", "linear", 1.0, "flag"),
    _f("kind_cpu", "linear", 1.0, "flag"),
)

HOST_FEATURES: tuple[Feature, ...] = (
    _f("n_devices", "log1p", 8.0, "devices"),
    _f("n_idle_devices", "log1p", 8.0, "healthy devices without tasks"),
    _f("cpu_cores", "log1p", 64.0, "cores"),
    _f("memory_gb", "log1p", 512.0, "GB"),
    _f("link_gbps", "log1p", 100.0, "GB/s of links touching the host"),
    _f("has_rack", "linear", 1.0, "flag"),
    _f("placeholder", "linear", 1.0, "flag: named by a device, never described"),
    _f("spread_gangs", "log1p", 1.0, "placed or running gangs across hosts with a device here (sharing its uplink)"),
)

SWITCH_FEATURES: tuple[Feature, ...] = (
    _f("n_children", "log1p", 16.0, "hosts and switches below"),
    _f("is_top", "linear", 1.0, "flag: no parent"),
    _f("link_gbps", "log1p", 400.0, "GB/s of links touching the switch"),
    _f("placeholder", "linear", 1.0, "flag"),
)

TASK_FEATURES: tuple[Feature, ...] = (
    _f("work_ref_s", "log1p", 3600.0, "s on one reference device"),
    _f("gang", "log1p", 1.0, "devices"),
    _f("memory_per_device_gb", "log1p", 16.0, "GB"),
    _f("total_memory_gb", "log1p", 64.0, "GB over the gang"),
    _f("priority", "symlog", 1.0, "higher runs first"),
    _f("waiting_s", "log1p", 60.0, "s since submission"),
    _f("pending", "linear", 1.0, "flag"),
    _f("placed", "linear", 1.0, "flag"),
    _f("running", "linear", 1.0, "flag"),
    _f("kind_training", "linear", 1.0, "flag"),
    _f("kind_inference", "linear", 1.0, "flag"),
    _f("kind_batch_stage", "linear", 1.0, "flag"),
    _f("n_dependencies", "log1p", 1.0, "tasks"),
    _f("dependency_gb", "log1p", 1.0, "GB to transfer in"),
    _f("has_deadline", "linear", 1.0, "flag"),
    _f("deadline_slack_s", "symlog", 600.0, "s from now to the deadline"),
    _f("latency_slo_ms", "log1p", 100.0, "ms; 0: none"),
    _f("restricted", "linear", 1.0, "flag: allowed kinds or models are listed"),
)

# What the speed head reads of the task: its shape as it bears on speed (workload family, gang,
# placement, kind), never its size, priority or waiting time, so one prediction serves every task
# of a shape. A family the schema does not list (or a task that declares none) sets no family flag.
WORKLOAD_FAMILIES: tuple[str, ...] = ("a3c", "cyclegan", "lm", "recommendation", "resnet18", "resnet50", "transformer")
SHAPE_FEATURES: tuple[Feature, ...] = (
    *(
        _f(f"family_{name}", "linear", 1.0, "flag: the task declares this workload family")
        for name in WORKLOAD_FAMILIES
    ),
    _f("family_unknown", "linear", 1.0, "flag: no family, or one the model was not trained on"),
    _f("gang", "log1p", 1.0, "devices"),
    _f("spread", "linear", 1.0, "flag: a gang across hosts"),
    _f("kind_training", "linear", 1.0, "flag"),
    _f("kind_inference", "linear", 1.0, "flag"),
    _f("kind_batch_stage", "linear", 1.0, "flag"),
)

# What the speed head reads of a (task shape, device) pair: the prior's estimate it corrects.
PRIOR_FEATURES: tuple[Feature, ...] = (
    _f("log_prior_speed", "linear", 1.0, "log of the profiles' speed relative to the reference device"),
    _f("profiled", "linear", 1.0, "flag: the device's model is listed in the profiles"),
)

# Edge lists of the encoder, in input order: (name, destination type, source type).
NEIGHBOUR_LISTS: tuple[tuple[str, str, str], ...] = (
    ("device_host", "device", "host"),  # the device's host (K = 1)
    ("host_device", "host", "device"),  # the host's devices
    ("host_rack", "host", "switch"),  # the host's rack switch, if any (K = 1)
    ("rack_host", "switch", "host"),  # the hosts in a rack
    ("task_device", "task", "device"),  # devices a placed/running task holds
    ("device_task", "device", "task"),  # tasks placed/running on a device
    ("task_parent", "task", "task"),  # live tasks whose output this task needs
    ("task_child", "task", "task"),  # live tasks that need this task's output
)
NODE_TYPES: tuple[str, ...] = ("device", "host", "switch", "task")


def names(features: tuple[Feature, ...]) -> list[str]:
    return [f.name for f in features]


def schema() -> dict[str, object]:
    """The feature schema as plain data (written into the ONNX metadata; checked at load)."""
    return {
        "version": FEATURE_SCHEMA_VERSION,
        "clip": CLIP,
        "reference_peak_tflops": REFERENCE_PEAK_TFLOPS,
        "device": [f.as_dict() for f in DEVICE_FEATURES],
        "host": [f.as_dict() for f in HOST_FEATURES],
        "switch": [f.as_dict() for f in SWITCH_FEATURES],
        "task": [f.as_dict() for f in TASK_FEATURES],
        "shape": [f.as_dict() for f in SHAPE_FEATURES],
        "prior": [f.as_dict() for f in PRIOR_FEATURES],
        "neighbours": [list(n) for n in NEIGHBOUR_LISTS],
        "output": ["log_speed_ratio", "log_sigma"],
    }


_TRANSFORMS: dict[int, tuple[tuple[Feature, ...], NDArray[np.float64], NDArray[np.int64], NDArray[np.int64]]] = {}


def _transforms(features: tuple[Feature, ...]) -> tuple[NDArray[np.float64], NDArray[np.int64], NDArray[np.int64]]:
    """Per-column scales [F] and the columns that take log1p and symlog, for :func:`normalize`.

    Kept by the tuple's identity (hashing a tuple of features costs more than the lookup saves).
    """
    cached = _TRANSFORMS.get(id(features))
    if cached is None or cached[0] is not features:
        scales = np.array([f.scale for f in features], dtype=np.float64)
        log1p = np.array([j for j, f in enumerate(features) if f.transform == "log1p"], dtype=np.int64)
        symlog = np.array([j for j, f in enumerate(features) if f.transform == "symlog"], dtype=np.int64)
        cached = _TRANSFORMS[id(features)] = (features, scales, log1p, symlog)
    return cached[1], cached[2], cached[3]


def normalize(raw: NDArray[np.float64], features: tuple[Feature, ...]) -> Matrix:
    """Scale raw columns by their features' transforms. Shapes: [N, F] float64 -> [N, F] float32.

    Whole-matrix operations (one per transform, not one per column): a decision builds these for
    a handful of candidates, where numpy's per-call overhead is what costs.
    """
    if raw.shape[1] != len(features):
        raise ValueError(f"{raw.shape[1]} columns for {len(features)} features")
    scales, log1p, symlog = _transforms(features)
    out = np.where(np.isfinite(raw), raw, 0.0) / scales  # nan_to_num's values at half its cost
    if len(log1p):
        out[:, log1p] = np.log1p(np.maximum(out[:, log1p], 0.0))
    if len(symlog):
        x = out[:, symlog]
        out[:, symlog] = np.sign(x) * np.log1p(np.abs(x))
    return np.clip(out, -CLIP, CLIP).astype(np.float32)


@dataclass(frozen=True)
class Neighbours:
    """A padded neighbour list. Shapes: index int64 [N, K] in [0, n_src]; mask float32 [N, K]."""

    index: Index
    mask: Matrix
    n_src: int

    @property
    def degree(self) -> NDArray[np.float32]:
        """Real neighbours per destination. [N]."""
        degree: NDArray[np.float32] = self.mask.sum(axis=1)
        return degree


def neighbours(dst: Index, src: Index, n_dst: int, n_src: int, k_max: int | None = None) -> Neighbours:
    """Padded lists from edges ``src[e] -> dst[e]`` (positions). Shapes: dst, src [E] -> [n_dst, K].

    Within a row, neighbours keep edge order; duplicates stay. ``k_max``: a row of more neighbours
    keeps ``k_max`` of them, evenly spaced in edge order (first included), so that ``K`` (every
    row's width) is at most ``k_max``. Vectorized, no loop over nodes.
    """
    counts = np.bincount(dst, minlength=n_dst) if len(dst) else np.zeros(n_dst, dtype=np.int64)
    largest = int(counts.max(initial=0))
    k = max(1, largest if k_max is None else min(largest, k_max))
    index = np.full((n_dst, k), n_src, dtype=np.int64)
    mask = np.zeros((n_dst, k), dtype=np.float32)
    if len(dst):
        order = np.argsort(dst, kind="stable")
        dst_sorted, src_sorted = dst[order], src[order]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        slot = np.arange(len(dst)) - starts[dst_sorted]
        if largest > k:  # a row of c > k neighbours keeps slots floor(j * c / k), j < k, as slot j
            c = counts[dst_sorted]
            sampled = np.where(c > k, (slot * k + c - 1) // c, slot)
            keep = (c <= k) | ((sampled * c // k == slot) & (sampled < k))
            dst_sorted, src_sorted, slot = dst_sorted[keep], src_sorted[keep], sampled[keep]
        index[dst_sorted, slot] = src_sorted
        mask[dst_sorted, slot] = 1.0
    return Neighbours(index, mask, n_src)


@dataclass(frozen=True)
class EncoderInputs:
    """Everything the encoder reads, for one graph at one instant.

    Shapes: device_x [D, len(DEVICE_FEATURES)], host_x [H, ...], switch_x [S, ...], task_x [T, ...]
    (float32); ``device_rows`` [D], ``host_rows`` [H], ``switch_rows`` [S], ``task_rows`` [T] map
    positions to graph (table) rows; ``task_ids`` [T]; one :class:`Neighbours` per
    :data:`NEIGHBOUR_LISTS` entry.
    """

    device_x: Matrix
    host_x: Matrix
    switch_x: Matrix
    task_x: Matrix
    device_rows: Rows
    host_rows: Rows
    switch_rows: Rows
    task_rows: Rows
    task_ids: list[str]
    lists: dict[str, Neighbours]

    def feeds(self) -> dict[str, NDArray[np.float32] | NDArray[np.int64]]:
        """The encoder's ONNX inputs by name: ``<type>_x`` then ``<list>_index`` / ``<list>_mask``."""
        out: dict[str, NDArray[np.float32] | NDArray[np.int64]] = {
            "device_x": self.device_x,
            "host_x": self.host_x,
            "switch_x": self.switch_x,
            "task_x": self.task_x,
        }
        for name, _, _ in NEIGHBOUR_LISTS:
            out[f"{name}_index"] = self.lists[name].index
            out[f"{name}_mask"] = self.lists[name].mask
        return out

    def without_edges(self) -> EncoderInputs:
        """The same nodes with every neighbour list empty (no message passing)."""
        sizes = {"device": len(self.device_x), "host": len(self.host_x)}
        sizes |= {"switch": len(self.switch_x), "task": len(self.task_x)}
        none = np.zeros(0, dtype=np.int64)
        lists = {name: neighbours(none, none, sizes[dst], sizes[src]) for name, dst, src in NEIGHBOUR_LISTS}
        return replace(self, lists=lists)

    def device_positions(self, rows: Rows) -> Index:
        """Positions (rows of ``device_x``) of graph device rows; raises KeyError for an unknown row."""
        where = np.searchsorted(self.device_rows, rows)
        found = where < len(self.device_rows)
        found[found] = self.device_rows[where[found]] == rows[found]
        if not found.all():
            raise KeyError(f"device rows {rows[~found].tolist()} are not in these inputs")
        positions: Index = where.astype(np.int64)
        return positions


def encoder_feed_names() -> list[str]:
    """Encoder input names in order (matches :meth:`EncoderInputs.feeds`)."""
    out = ["device_x", "host_x", "switch_x", "task_x"]
    for name, _, _ in NEIGHBOUR_LISTS:
        out += [f"{name}_index", f"{name}_mask"]
    return out


SCORER_FEED_NAMES: tuple[str, ...] = ("shape_x", "device_emb", "prior_x", "context")


def _positions(alive_rows: Rows, capacity: int) -> Index:
    """Graph row -> position (-1 where not live). [capacity]."""
    where = np.full(capacity, -1, dtype=np.int64)
    where[alive_rows] = np.arange(len(alive_rows), dtype=np.int64)
    return where


def _link_gbps(graph: InfraGraph, node_type: int, capacity: int) -> NDArray[np.float64]:
    """Sum of the bandwidth of live links touching each row of one node type. [capacity] GB/s."""
    t = graph.links
    live = t.alive
    total = np.zeros(capacity, dtype=np.float64)
    for types, ends in ((t.src_type, t.src), (t.dst_type, t.dst)):
        hit = live & (types == node_type) & (ends >= 0) & (ends < capacity)
        total += np.bincount(ends[hit], weights=t.bandwidth_gbps[hit], minlength=capacity)[:capacity]
    return total


def device_matrix(graph: InfraGraph, rows: Rows) -> Matrix:
    """Device features of graph rows. Shapes: rows [D] -> [D, len(DEVICE_FEATURES)]."""
    d = graph.devices
    memory = d.memory_gb[rows]
    free = np.maximum(graph.free_memory_gb(rows), 0.0)
    safe_memory = np.where(memory > 0, memory, 1.0)
    peak_power = d.peak_power_w[rows]
    safe_power = np.where(peak_power > 0, peak_power, 1.0)
    health = d.health[rows]
    kind = d.kind[rows]
    links = _link_gbps(graph, DEVICE_NODE, d.capacity)[rows]
    raw = np.column_stack(
        [
            d.peak_tflops[rows],
            memory,
            free,
            np.where(memory > 0, free / safe_memory, 0.0),
            np.minimum(d.reserved_gb[rows] / safe_memory, 1.0) * (memory > 0),
            d.utilization[rows],
            graph.load(rows),
            d.power_w[rows],
            d.idle_power_w[rows],
            peak_power,
            np.where(peak_power > 0, np.minimum(d.power_w[rows] / safe_power, 1.0), 0.0),
            np.where(peak_power > 0, d.peak_tflops[rows] / safe_power, 0.0),
            d.temperature_c[rows],
            (health == ev.HEALTH_HEALTHY) | (health == ev.HEALTH_UNSPECIFIED),
            health == ev.HEALTH_DEGRADED,
            health == ev.HEALTH_FAILED,
            d.n_tasks[rows],
            links,
            kind == ev.DEVICE_KIND_GPU,
            kind == ev.DEVICE_KIND_TPU,
            kind == ev.DEVICE_KIND_FPGA,
            kind == ev.DEVICE_KIND_ASIC,
            kind == ev.DEVICE_KIND_CPU,
        ]
    ).astype(np.float64)
    return normalize(raw.reshape(len(rows), len(DEVICE_FEATURES)), DEVICE_FEATURES)


def _host_matrix(graph: InfraGraph, rows: Rows, device_rows: Rows, spread_gangs: NDArray[np.int64]) -> Matrix:
    """Host features of graph ``rows``; ``spread_gangs`` [H] by host position (:func:`_spread_gangs`)."""
    h, d = graph.hosts, graph.devices
    idle = (d.n_tasks[device_rows] == 0) & (d.health[device_rows] != ev.HEALTH_FAILED)
    n_idle = np.bincount(d.host[device_rows][idle], minlength=h.capacity)[: h.capacity]
    raw = np.column_stack(
        [
            h.n_devices[rows],
            n_idle[rows],
            h.cpu_cores[rows],
            h.memory_gb[rows],
            _link_gbps(graph, HOST_NODE, h.capacity)[rows],
            h.rack[rows] >= 0,
            h.placeholder[rows],
            spread_gangs,
        ]
    ).astype(np.float64)
    return normalize(raw.reshape(len(rows), len(HOST_FEATURES)), HOST_FEATURES)


def _spread_gangs(held_t: Index, held_d: Index, dev_host: Index, n_host: int) -> NDArray[np.int64]:
    """Per host position, the placed or running tasks holding devices on more than one host that
    hold one there: the gangs sharing the host's uplink. Shapes: held_t, held_d [E] -> [n_host]."""
    if not len(held_t) or n_host == 0:
        return np.zeros(n_host, dtype=np.int64)
    hosts = dev_host[held_d]
    known = hosts >= 0
    pairs = np.unique(held_t[known] * n_host + hosts[known])  # (task, host) once each
    task, host = pairs // n_host, pairs % n_host
    hosts_per_task = np.bincount(task)
    spread = hosts_per_task[task] > 1
    counts: NDArray[np.int64] = np.bincount(host[spread], minlength=n_host)[:n_host].astype(np.int64)
    return counts


def _switch_matrix(graph: InfraGraph, rows: Rows) -> Matrix:
    s = graph.switches
    raw = np.column_stack(
        [
            s.n_children[rows],
            s.parent[rows] < 0,
            _link_gbps(graph, SWITCH_NODE, s.capacity)[rows],
            s.placeholder[rows],
        ]
    ).astype(np.float64)
    return normalize(raw.reshape(len(rows), len(SWITCH_FEATURES)), SWITCH_FEATURES)


def _spec_columns(spec: ev.TaskSpec, now_ms: int) -> tuple[float, float, float, float, float, float, float]:
    """Per-spec raw values: n_deps, dependency_gb, has_deadline, slack_s, slo_ms, restricted, waiting_s."""
    slack = (spec.deadline_ms - now_ms) / 1000.0 if spec.deadline_ms and now_ms else 0.0
    waiting = max(0.0, (now_ms - spec.submit_time_ms) / 1000.0) if spec.submit_time_ms and now_ms else 0.0
    return (
        float(len(spec.dependencies)),
        float(sum(dep.transfer_gb for dep in spec.dependencies)),
        float(spec.deadline_ms > 0),
        slack,
        spec.latency_slo_ms,
        float(bool(spec.allowed_kinds) or bool(spec.allowed_models)),
        waiting,
    )


def task_matrix(specs: list[ev.TaskSpec], states: list[TaskState], now_ms: int = 0) -> Matrix:
    """Task features. ``now_ms`` (Unix ms; 0: unknown) dates waiting time and deadline slack.

    Shapes: specs, states [T] -> [T, len(TASK_FEATURES)].
    """
    rows = [_task_row(spec, state, now_ms) for spec, state in zip(specs, states, strict=True)]
    raw = np.array(rows, dtype=np.float64).reshape(len(rows), len(TASK_FEATURES))
    return normalize(raw, TASK_FEATURES)


def _task_row(spec: ev.TaskSpec, state: TaskState, now_ms: int) -> tuple[float, ...]:
    """One task's raw feature values, in ``TASK_FEATURES`` order."""
    gang = max(1, spec.num_devices)
    n_deps, dep_gb, has_deadline, slack, slo, restricted, waiting = _spec_columns(spec, now_ms)
    return (
        spec.work_ref_s,
        gang,
        spec.memory_per_device_gb,
        gang * spec.memory_per_device_gb,
        spec.priority,
        waiting,
        state == TaskState.PENDING,
        state == TaskState.PLACED,
        state == TaskState.RUNNING,
        spec.kind == ev.TASK_KIND_TRAINING,
        spec.kind == ev.TASK_KIND_INFERENCE,
        spec.kind == ev.TASK_KIND_BATCH_STAGE,
        n_deps,
        dep_gb,
        has_deadline,
        slack,
        slo,
        restricted,
    )


def task_table_matrix(table: TaskTable, rows: Rows, now_ms: int = 0) -> Matrix:
    """Task features of live task-table ``rows``, the values :func:`task_matrix` computes from the
    specs, read from the table's columns instead (the encoder reads every live task on each refresh).

    Shapes: rows [T] -> [T, len(TASK_FEATURES)].
    """
    gang = table.gang[rows].astype(np.float64)
    memory = table.memory_per_device_gb[rows]
    submit, deadline = table.submit_time_ms[rows], table.deadline_ms[rows]
    state, kind = table.state[rows], table.kind[rows]
    if now_ms:
        waiting = np.where(submit != 0, np.maximum(0.0, (now_ms - submit) / 1000.0), 0.0)
        slack = np.where(deadline != 0, (deadline - now_ms) / 1000.0, 0.0)
    else:
        waiting = slack = np.zeros(len(rows))
    raw = np.column_stack(
        [
            table.work_ref_s[rows],
            gang,
            memory,
            gang * memory,
            table.priority[rows],
            waiting,
            state == TaskState.PENDING,
            state == TaskState.PLACED,
            state == TaskState.RUNNING,
            kind == ev.TASK_KIND_TRAINING,
            kind == ev.TASK_KIND_INFERENCE,
            kind == ev.TASK_KIND_BATCH_STAGE,
            table.n_dependencies[rows],
            table.dependency_gb[rows],
            deadline > 0,
            slack,
            table.latency_slo_ms[rows],
            table.restricted[rows],
        ]
    ).astype(np.float64)
    return normalize(raw.reshape(len(rows), len(TASK_FEATURES)), TASK_FEATURES)


def encoded_task_rows(table: TaskTable, max_pending: int = PENDING_ENCODED_MAX) -> Rows:
    """The live task rows the encoder reads, ascending: every one that is not pending and, of the
    pending ones, all when at most ``max_pending``, else ``max_pending`` evenly spaced among them
    (:data:`PENDING_ENCODED_MAX`)."""
    rows = table.live_rows()
    pending = table.state[rows] == TaskState.PENDING
    count = int(np.count_nonzero(pending))
    if count <= max_pending:
        return rows
    keep = ~pending
    # Spaced more than one apart when count > max_pending, so no position is taken twice.
    keep[np.flatnonzero(pending)[np.linspace(0, count - 1, max_pending).astype(np.int64)]] = True
    kept: Rows = rows[keep]
    return kept


def encoder_inputs(
    graph: InfraGraph, now_ms: int = 0, message_passing: bool = True, max_pending: int = PENDING_ENCODED_MAX
) -> EncoderInputs:
    """The encoder's inputs for the whole graph: every live device, host, switch and live task, of
    the pending tasks at most ``max_pending`` (:func:`encoded_task_rows`). Without
    ``message_passing`` every neighbour list is empty: each node sees its own features only (the
    ablation a model trained that way reads, ``gnn-no-graph``).

    Vectorized over devices, hosts, switches and tasks (the task table's columns); Python visits
    only the tasks with dependencies and those holding more than one device (their lists live in
    the specs and ``Task.device_rows``). Runs under the daemon's lock: its cost is a pause for requests.
    """
    d, h, s = graph.devices, graph.hosts, graph.switches
    device_rows, host_rows, switch_rows = d.live_rows(), h.live_rows(), s.live_rows()
    n_dev, n_host, n_sw = len(device_rows), len(host_rows), len(switch_rows)
    device_pos = _positions(device_rows, d.capacity)
    host_pos = _positions(host_rows, h.capacity)
    switch_pos = _positions(switch_rows, s.capacity)

    t = graph.task_table
    task_rows = encoded_task_rows(t, max_pending)
    task_ids = [t.ids[row] or "" for row in task_rows.tolist()]
    task_pos = _positions(task_rows, t.capacity)
    n_task = len(task_rows)

    dev_host = host_pos[d.host[device_rows]]  # [D] host positions
    racks = h.rack[host_rows]
    host_switch = np.where(racks >= 0, switch_pos[np.maximum(racks, 0)], -1)
    with_rack = np.flatnonzero(host_switch >= 0)

    held_t, held_d = _holders(graph, task_rows, task_ids, device_pos)
    parents, children = _dependency_edges(graph, task_rows, task_ids, task_pos)
    all_dev = np.arange(n_dev, dtype=np.int64)
    rack_hosts = np.arange(n_host, dtype=np.int64)[with_rack]

    lists = {
        "device_host": neighbours(all_dev, dev_host, n_dev, n_host),
        "host_device": neighbours(dev_host, all_dev, n_host, n_dev),
        "host_rack": neighbours(rack_hosts, host_switch[with_rack], n_host, n_sw),
        "rack_host": neighbours(host_switch[with_rack], rack_hosts, n_sw, n_host),
        "task_device": neighbours(held_t, held_d, n_task, n_dev, TASK_NEIGHBOURS_MAX),
        "device_task": neighbours(held_d, held_t, n_dev, n_task, TASK_NEIGHBOURS_MAX),
        "task_parent": neighbours(children, parents, n_task, n_task, TASK_NEIGHBOURS_MAX),
        "task_child": neighbours(parents, children, n_task, n_task, TASK_NEIGHBOURS_MAX),
    }
    inputs = EncoderInputs(
        device_x=device_matrix(graph, device_rows),
        host_x=_host_matrix(graph, host_rows, device_rows, _spread_gangs(held_t, held_d, dev_host, n_host)),
        switch_x=_switch_matrix(graph, switch_rows),
        task_x=task_table_matrix(t, task_rows, now_ms),
        device_rows=device_rows,
        host_rows=host_rows,
        switch_rows=switch_rows,
        task_rows=task_rows,
        task_ids=task_ids,
        lists=lists,
    )
    return inputs if message_passing else inputs.without_edges()


def _holders(graph: InfraGraph, task_rows: Rows, task_ids: list[str], device_pos: Index) -> tuple[Index, Index]:
    """Edges task position -> device position of the placed and running tasks, in task order (a
    gang's devices in its order). Shapes: -> [E], [E]."""
    t, d = graph.task_table, graph.devices
    state, held = t.state[task_rows], t.held[task_rows]
    holding = (state == TaskState.PLACED) | (state == TaskState.RUNNING)
    one = np.flatnonzero(holding & (held == 1))  # its device is live: a device holding tasks cannot be removed
    tasks, devices = [one], [device_pos[t.held_device[task_rows[one]]]]
    for i in np.flatnonzero(holding & (held > 1)).tolist():
        task = graph.tasks[task_ids[i]]
        rows = [
            r
            for r, dev in zip(task.device_rows, task.device_ids, strict=True)
            if 0 <= r < d.capacity and d.ids[r] == dev
        ]
        tasks.append(np.full(len(rows), i, dtype=np.int64))
        devices.append(device_pos[np.array(rows, dtype=np.int64)])
    task_of, device_of = np.concatenate(tasks).astype(np.int64), np.concatenate(devices).astype(np.int64)
    order = np.argsort(task_of, kind="stable")
    return task_of[order], device_of[order]


def _dependency_edges(graph: InfraGraph, task_rows: Rows, task_ids: list[str], task_pos: Index) -> tuple[Index, Index]:
    """Edges parent -> child (task positions) between the encoded tasks, in child order. Shapes:
    -> [E], [E].

    Only a pending task can have a live parent (a task is placed once every dependency finished,
    and a finished task leaves the table), and of a task's dependencies at most
    :data:`DEPENDENCIES_READ` are looked up, evenly spaced in its list: a refresh costs no more
    than that a pending task, however long its list (``limits.list_items``, 4,096 by default)."""
    t = graph.task_table
    parents: list[int] = []
    children: list[int] = []
    waiting = (t.n_dependencies[task_rows] > 0) & (t.state[task_rows] == TaskState.PENDING)
    for i in np.flatnonzero(waiting).tolist():
        dependencies = graph.tasks[task_ids[i]].spec.dependencies
        count = len(dependencies)
        read = (
            dependencies
            if count <= DEPENDENCIES_READ
            else [dependencies[j] for j in np.linspace(0, count - 1, DEPENDENCIES_READ).astype(np.int64).tolist()]
        )
        for dep in read:
            row = t.index.get(dep.task_id)
            if row is not None and task_pos[row] >= 0:  # a pending parent left out of a long queue: none
                parents.append(int(task_pos[row]))
                children.append(i)
    return np.array(parents, dtype=np.int64), np.array(children, dtype=np.int64)


# The profiles' names of the kinds a device model may run, and the DAG stages besides.
TASK_KIND_NAMES: dict[int, str] = {**PROFILE_TASK_KINDS, ev.TASK_KIND_BATCH_STAGE: "batch_stage"}


def shape_names(spec: ev.TaskSpec) -> tuple[str, str]:
    """``spec``'s declared workload family ("" for none, or one the schema does not list) and its
    kind's name (``unspecified`` for none), as a model records the shapes it was trained on."""
    family = workload_family(spec.workload_class)
    return (family if family in WORKLOAD_FAMILIES else ""), TASK_KIND_NAMES.get(int(spec.kind), "unspecified")


def shape_names_of(shape_x: Matrix) -> tuple[str, str]:
    """:func:`shape_names` read back from a :func:`shape_features` row."""
    names = [f.name for f in SHAPE_FEATURES]
    flags = {name: bool(value > 0.5) for name, value in zip(names, shape_x.tolist(), strict=True)}
    family = next((f for f in WORKLOAD_FAMILIES if flags[f"family_{f}"]), "")
    kind = next((k for k in TASK_KIND_NAMES.values() if flags[f"kind_{k}"]), "unspecified")
    return family, kind


def shape_features(spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True) -> Matrix:
    """The speed head's task input: ``spec``'s shape as a member of a gang of ``gang`` devices
    (default: its own size) on one host (``consolidated``) or spread. -> [len(SHAPE_FEATURES)]."""
    size = max(1, spec.num_devices) if gang is None else max(1, gang)
    family = workload_family(spec.workload_class)
    flags = [float(family == name) for name in WORKLOAD_FAMILIES]
    raw = [
        *flags,
        float(not any(flags)),
        float(size),
        float(size > 1 and not consolidated),
        float(spec.kind == ev.TASK_KIND_TRAINING),
        float(spec.kind == ev.TASK_KIND_INFERENCE),
        float(spec.kind == ev.TASK_KIND_BATCH_STAGE),
    ]
    row: Matrix = normalize(np.array([raw], dtype=np.float64), SHAPE_FEATURES)[0]
    return row


def prior_features(
    spec: ev.TaskSpec,
    graph: InfraGraph,
    rows: Rows,
    profiles: DeviceProfiles,
    gang: int | None = None,
    consolidated: bool = True,
) -> Matrix:
    """The speed head's pair input: the log of ``profiles``' speed of the task on each row (the
    estimate the model corrects) and whether the row's model is listed. [C] -> [C, len(PRIOR_FEATURES)]."""
    speed = profiles.device_speedups(graph, rows, spec, gang, consolidated)
    listed = profiles.listed(graph.model_names)[graph.devices.model[rows]]
    raw = np.column_stack([np.log(np.maximum(speed, 1e-6)), listed.astype(np.float64)])
    return normalize(raw.reshape(len(rows), len(PRIOR_FEATURES)), PRIOR_FEATURES)
