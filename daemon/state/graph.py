"""The daemon's picture of the infrastructure: devices, hosts, switches, links and tasks.

Each node and edge type is a :class:`Table`: a struct of numpy arrays indexed by row, an id map
and a free list. Adding, changing and removing an entity is O(1) amortized (rows are reused,
arrays grow by doubling) and a batch of metrics is applied vectorized; nothing is ever rebuilt per
event. Row numbers are stable while an entity lives, so features and policies work on row arrays.

References between tables are rows: a device names its host row, a host its rack (switch) row.
A device may arrive before its host (or a host before its rack): a placeholder row is created
and filled in when the upsert comes. Pure: no I/O, no clock; callers pass event times in.
"""

from __future__ import annotations

import copy
import enum
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.errors import InvalidEventError
from hlb.v1 import events_pb2 as ev

MAX_GANG = 4096
MAX_MEMORY_GB = 1.0e6
MAX_ID_CHARS = 256
MAX_CACHED_GROUP_SETS = 64  # allow-list combinations whose rows a graph keeps sorted
# Labels an inference service (latency_slo_ms > 0) may carry so that hlb can estimate its request
# latency on each device model: requests per second, and one request's work in reference-device
# milliseconds (as work_ref_s is in seconds). Numbers in (0, 1e9]; checked with the spec.
REQUEST_RATE_LABEL = "request_rate_per_s"
REQUEST_WORK_LABEL = "request_work_ref_ms"
SERVICE_LOAD_LABELS = (REQUEST_RATE_LABEL, REQUEST_WORK_LABEL)

Rows = NDArray[np.int64]
DEVICE_KINDS = frozenset(ev.DeviceKind.values()) - {ev.DEVICE_KIND_UNSPECIFIED}  # what a device may be
MAX_HEALTH = max(ev.Health.values())

KIND_NAMES: dict[int, str] = {
    int(value): name.removeprefix("DEVICE_KIND_").lower() for name, value in ev.DeviceKind.items()
}

# proto3 enums are open (any int32 decodes): the values a task spec may name.
TASK_KINDS = frozenset(int(v) for v in ev.TaskKind.values())

# Endpoint types of a link (``LinkTable.src_type`` / ``dst_type``).
DEVICE_NODE, HOST_NODE, SWITCH_NODE = 0, 1, 2


class TaskState(enum.IntEnum):
    PENDING = 0
    PLACED = 1
    RUNNING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def holds_devices(self) -> bool:
        return self in (TaskState.PLACED, TaskState.RUNNING)

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = (TaskState.FINISHED, TaskState.FAILED, TaskState.CANCELLED)  # a tuple: members compare by identity


class Table:
    """Rows of one entity type: an id map, a free list, and numpy columns of one length.

    Subclasses list their columns in ``COLUMNS`` (name -> (dtype, default)); each becomes an
    attribute holding an array of length ``capacity``. Only rows with ``alive[row]`` set mean
    anything; a removed row goes to the free list and is reset to the defaults when reused.
    """

    COLUMNS: ClassVar[dict[str, tuple[type[np.generic], float]]] = {}
    # Columns a snapshot may lack (written before they existed); restoring one leaves them at
    # their defaults for the owner to fill.
    LATER_COLUMNS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, capacity: int = 16) -> None:
        self.ids: list[str | None] = [None] * capacity
        self.index: dict[str, int] = {}
        self.generation = 0  # grows whenever an id gains or loses its row (caches of id -> row check it)
        self.alive: NDArray[np.bool_] = np.zeros(capacity, dtype=np.bool_)
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest row
        for name, (dtype, default) in self.COLUMNS.items():
            setattr(self, name, np.full(capacity, default, dtype=dtype))

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, entity_id: object) -> bool:
        return entity_id in self.index

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def row(self, entity_id: str) -> int | None:
        return self.index.get(entity_id)

    def live_rows(self) -> Rows:
        """Rows of every live entity, ascending. Shapes: -> [len(self)] int64."""
        return np.flatnonzero(self.alive).astype(np.int64)

    def add(self, entity_id: str) -> int:
        """A fresh row (defaults in every column) for a new id; the id must not be live."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.generation += 1
        self.ids[row] = entity_id
        self.index[entity_id] = row
        self.alive[row] = True
        return row

    def remove(self, entity_id: str) -> int | None:
        """Free the id's row (reset to defaults); returns it, or None when the id is not live."""
        row = self.index.pop(entity_id, None)
        if row is None:
            return None
        self.generation += 1
        self.ids[row] = None
        self.alive[row] = False
        for name, (_, default) in self.COLUMNS.items():
            getattr(self, name)[row] = default
        self._free.append(row)
        return row

    def copy(self) -> Self:
        """An independent copy of the rows (columns, ids, id map and free list)."""
        twin = copy.copy(self)
        twin.ids, twin.index, twin._free = list(self.ids), dict(self.index), list(self._free)
        twin.alive = self.alive.copy()
        for name in self.COLUMNS:
            setattr(twin, name, getattr(self, name).copy())
        return twin

    def nbytes(self) -> int:
        """Bytes held by the numpy columns (not the id strings)."""
        arrays = [self.alive, *(getattr(self, name) for name in self.COLUMNS)]
        return sum(int(a.nbytes) for a in arrays)

    def _grow(self) -> None:
        old = self.capacity
        new = max(16, old * 2)
        self.ids.extend([None] * (new - old))
        self.alive = np.concatenate([self.alive, np.zeros(new - old, dtype=np.bool_)])
        for name, (dtype, default) in self.COLUMNS.items():
            column: NDArray[Any] = getattr(self, name)
            setattr(self, name, np.concatenate([column, np.full(new - old, default, dtype=dtype)]))
        self._free.extend(range(new - 1, old - 1, -1))


class DeviceTable(Table):
    COLUMNS: ClassVar[dict[str, tuple[type[np.generic], float]]] = {
        "kind": (np.int8, 0),
        "model": (np.int32, -1),  # index into InfraGraph.model_names
        "host": (np.int32, -1),  # row in InfraGraph.hosts
        "memory_gb": (np.float64, 0.0),
        "peak_tflops": (np.float64, 0.0),
        "idle_power_w": (np.float64, 0.0),
        "peak_power_w": (np.float64, 0.0),
        "utilization": (np.float64, 0.0),
        "memory_used_gb": (np.float64, 0.0),
        "power_w": (np.float64, 0.0),
        "temperature_c": (np.float64, 0.0),
        "health": (np.int8, ev.HEALTH_HEALTHY),
        "reserved_gb": (np.float64, 0.0),  # memory hlb reserved for the tasks it placed here
        "placed_gb": (np.float64, 0.0),  # the part of reserved_gb whose tasks have not started yet
        "n_tasks": (np.int32, 0),  # tasks placed or running here
        "metrics_ms": (np.int64, 0),  # event time of the newest metrics
        # When a task slot is expected to be free again (Unix ms, from the run time estimate of the
        # tasks hlb placed here); 0: free, or no task here has an end to expect (a service).
        "free_at_ms": (np.int64, 0),
    }
    LATER_COLUMNS: ClassVar[frozenset[str]] = frozenset({"free_at_ms"})  # 0 until the next placement there
    kind: NDArray[np.int8]
    model: NDArray[np.int32]
    host: NDArray[np.int32]
    memory_gb: NDArray[np.float64]
    peak_tflops: NDArray[np.float64]
    idle_power_w: NDArray[np.float64]
    peak_power_w: NDArray[np.float64]
    utilization: NDArray[np.float64]
    memory_used_gb: NDArray[np.float64]
    power_w: NDArray[np.float64]
    temperature_c: NDArray[np.float64]
    health: NDArray[np.int8]
    reserved_gb: NDArray[np.float64]
    placed_gb: NDArray[np.float64]
    n_tasks: NDArray[np.int32]
    metrics_ms: NDArray[np.int64]
    free_at_ms: NDArray[np.int64]


class HostTable(Table):
    COLUMNS: ClassVar[dict[str, tuple[type[np.generic], float]]] = {
        "rack": (np.int32, -1),  # row in InfraGraph.switches; -1: none
        "cpu_cores": (np.float64, 0.0),
        "memory_gb": (np.float64, 0.0),
        "n_devices": (np.int32, 0),
        "placeholder": (np.bool_, True),  # named by a device, not yet upserted itself
    }
    rack: NDArray[np.int32]
    cpu_cores: NDArray[np.float64]
    memory_gb: NDArray[np.float64]
    n_devices: NDArray[np.int32]
    placeholder: NDArray[np.bool_]


class SwitchTable(Table):
    COLUMNS: ClassVar[dict[str, tuple[type[np.generic], float]]] = {
        "parent": (np.int32, -1),  # row in InfraGraph.switches; -1: top
        "n_children": (np.int32, 0),  # hosts and switches that hang off it
        "placeholder": (np.bool_, True),
    }
    parent: NDArray[np.int32]
    n_children: NDArray[np.int32]
    placeholder: NDArray[np.bool_]


class LinkTable(Table):
    COLUMNS: ClassVar[dict[str, tuple[type[np.generic], float]]] = {
        "src_type": (np.int8, -1),  # DEVICE_NODE | HOST_NODE | SWITCH_NODE
        "src": (np.int32, -1),
        "dst_type": (np.int8, -1),
        "dst": (np.int32, -1),
        "kind": (np.int8, 0),  # ev.LinkKind
        "bandwidth_gbps": (np.float64, 0.0),
        "latency_us": (np.float64, 0.0),
        "utilization": (np.float64, 0.0),
    }
    src_type: NDArray[np.int8]
    src: NDArray[np.int32]
    dst_type: NDArray[np.int8]
    dst: NDArray[np.int32]
    kind: NDArray[np.int8]
    bandwidth_gbps: NDArray[np.float64]
    latency_us: NDArray[np.float64]
    utilization: NDArray[np.float64]


class TaskTable(Table):
    """Numeric columns of the tasks that are not final (pending, placed, running), for features:
    the encoder reads every live task on each refresh, so none of it is read from the specs then.

    ``held`` counts the devices a placed or running task holds and ``held_device`` is the row of
    the first (-1 while it holds none); a task holding more (a gang) lists them in
    ``Task.device_rows``.
    """

    COLUMNS: ClassVar[dict[str, tuple[type[np.generic], float]]] = {
        "state": (np.int8, TaskState.PENDING),
        "kind": (np.int8, 0),  # ev.TaskKind
        "gang": (np.int32, 1),
        "memory_per_device_gb": (np.float64, 0.0),
        "work_ref_s": (np.float64, 0.0),
        "priority": (np.int32, 0),
        "arrival": (np.int64, 0),
        "submit_time_ms": (np.int64, 0),
        "n_dependencies": (np.int32, 0),
        "dependency_gb": (np.float64, 0.0),  # summed over the dependencies
        "deadline_ms": (np.int64, 0),
        "latency_slo_ms": (np.float64, 0.0),
        "restricted": (np.bool_, False),  # allowed kinds or models named
        "held": (np.int32, 0),
        "held_device": (np.int64, -1),
    }
    # Restoring a snapshot without them fills them from the tasks (``InfraGraph.describe_tasks``).
    LATER_COLUMNS: ClassVar[frozenset[str]] = frozenset(
        {"n_dependencies", "dependency_gb", "deadline_ms", "latency_slo_ms", "restricted", "held", "held_device"}
    )
    state: NDArray[np.int8]
    kind: NDArray[np.int8]
    gang: NDArray[np.int32]
    memory_per_device_gb: NDArray[np.float64]
    work_ref_s: NDArray[np.float64]
    priority: NDArray[np.int32]
    arrival: NDArray[np.int64]
    submit_time_ms: NDArray[np.int64]
    n_dependencies: NDArray[np.int32]
    dependency_gb: NDArray[np.float64]
    deadline_ms: NDArray[np.int64]
    latency_slo_ms: NDArray[np.float64]
    restricted: NDArray[np.bool_]
    held: NDArray[np.int32]
    held_device: NDArray[np.int64]

    def describe(self, row: int, spec: ev.TaskSpec, arrival: int, plain: bool = False) -> None:
        """Fill the columns of ``row``, a fresh one (its columns at their defaults), from the spec
        (the state and held devices are set apart). Columns that most specs leave at their default
        are set only when the spec names a value: a batch adds a thousand tasks in one lock hold.
        ``plain``: the spec is known to name no lists (``Task.plain``), which are then not read."""
        if spec.kind:
            self.kind[row] = spec.kind
        if spec.num_devices > 1:
            self.gang[row] = spec.num_devices
        self.memory_per_device_gb[row] = spec.memory_per_device_gb
        self.work_ref_s[row] = spec.work_ref_s
        if spec.priority:
            self.priority[row] = spec.priority
        self.arrival[row] = arrival
        if spec.submit_time_ms:
            self.submit_time_ms[row] = spec.submit_time_ms
        if spec.deadline_ms:
            self.deadline_ms[row] = spec.deadline_ms
        if spec.latency_slo_ms:
            self.latency_slo_ms[row] = spec.latency_slo_ms
        if plain:
            return
        if spec.dependencies:
            self.n_dependencies[row] = len(spec.dependencies)
            self.dependency_gb[row] = float(sum(dep.transfer_gb for dep in spec.dependencies))
        if spec.allowed_kinds or spec.allowed_models:
            self.restricted[row] = True

    def hold(self, row: int, device_rows: Sequence[int]) -> None:
        """``row``'s task now holds ``device_rows`` (empty: none)."""
        self.held[row] = len(device_rows)
        self.held_device[row] = device_rows[0] if device_rows else -1


@dataclass
class Task:
    spec: ev.TaskSpec
    cell: str
    arrival: int  # order of arrival, for FIFO within a priority
    row: int = -1  # row in InfraGraph.task_table while not final
    state: TaskState = TaskState.PENDING
    device_rows: tuple[int, ...] = ()
    device_ids: tuple[str, ...] = ()
    pending_reason: str = "not yet considered"
    # The spec names no dependencies, allowed kinds or models, preferred models or labels, as
    # ``check_task_specs`` found (False: not known, so read them). Reading one of these repeated
    # fields costs as much as a few plain ones, and a batch decision would read each several times.
    plain: bool = False

    @property
    def gang_size(self) -> int:
        return max(1, self.spec.num_devices)


@dataclass(frozen=True)
class Exclusion:
    """A device ruled out for a task: which hard constraint (a short name) and the detail in words."""

    device_id: str
    constraint: str  # "health" | "kind" | "model" | "memory"
    detail: str


CONSTRAINTS = ("health", "kind", "model", "capacity", "memory")


def _check_id(value: str, what: str) -> None:
    if not value:
        raise InvalidEventError(f"{what}: empty id", "missing_id")
    if len(value) > MAX_ID_CHARS:
        raise InvalidEventError(f"{what}: id longer than {MAX_ID_CHARS} characters", "invalid_id")


def _check_range(value: float, what: str, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidEventError(f"{what}={value!r} is outside [{low}, {high}]", "out_of_range")


def _check_ranges(values: NDArray[np.float64], ids: Sequence[str], what: str, low: float, high: Any) -> None:
    """Vectorized ``_check_range``; ``high`` may be an array (per-row bound). Names the first offender."""
    bad = ~(np.isfinite(values) & (values >= low) & (values <= high))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        bound = high[i] if isinstance(high, np.ndarray) else high
        raise InvalidEventError(f"device {ids[i]} {what}={values[i]!r} is outside [{low}, {bound}]", "out_of_range")


@dataclass(frozen=True)
class Occupancy:
    """What a binding changes on devices: tasks held, memory reserved, memory placed and not started.

    The graph's own values (:meth:`of`), or those after more bindings (:meth:`after`), so that a
    policy can score a device as it will be once more tasks are bound to it, with the same
    arithmetic as :meth:`InfraGraph.bind` (one addition per binding: the floats are the same).
    Shapes: [N] each, aligned with the rows they were read for.
    """

    n_tasks: NDArray[np.int32]
    reserved_gb: NDArray[np.float64]
    placed_gb: NDArray[np.float64]

    @classmethod
    def of(cls, graph: InfraGraph, rows: Rows) -> Occupancy:
        d = graph.devices
        return cls(d.n_tasks[rows], d.reserved_gb[rows], d.placed_gb[rows])

    def after(self, memory_gb: float) -> Occupancy:
        """One more task of ``memory_gb`` on every row, as ``bind`` adds it."""
        return Occupancy(self.n_tasks + 1, self.reserved_gb + memory_gb, self.placed_gb + memory_gb)

    @staticmethod
    def concat(parts: Sequence[Occupancy]) -> Occupancy:
        return Occupancy(
            np.concatenate([p.n_tasks for p in parts]),
            np.concatenate([p.reserved_gb for p in parts]),
            np.concatenate([p.placed_gb for p in parts]),
        )


class InfraGraph:
    """Devices, hosts, switches, links and tasks of one daemon, as struct-of-arrays tables.

    ``version`` grows with every inventory change and ``metrics_version`` with every metrics
    report; ``changes`` counts changed rows of either, so a cache of derived data (embeddings)
    can tell how much moved since it was computed.
    """

    def __init__(self, max_tasks_per_device: int = 1) -> None:
        # Tasks one device may hold at once; 1 (exclusive devices, as GPU device plugins and
        # Slurm's GRES give by default) unless the cluster shares devices (MPS, time slicing); 0: no limit.
        self.max_tasks_per_device = max_tasks_per_device
        self.devices = DeviceTable()
        self.hosts = HostTable()
        self.switches = SwitchTable()
        self.links = LinkTable()
        self.task_table = TaskTable()
        self.tasks: dict[str, Task] = {}
        self.model_names: list[str] = []
        self._model_index: dict[str, int] = {}
        # (kind, model index) -> live device rows; the cached arrays are rebuilt lazily per group.
        self._groups: dict[tuple[int, int], set[int]] = {}
        self._group_rows: dict[tuple[int, int], Rows] = {}
        # The same for the groups a task may use together (most tasks: every group), ascending.
        self._union_rows: dict[tuple[tuple[int, int], ...], Rows] = {}
        self._tasks_on_device: dict[int, set[str]] = {}
        self.newest_telemetry_ms = 0
        self.version = 0
        self.metrics_version = 0
        self.changes = 0
        self._arrivals = 0

    @property
    def exclusive(self) -> bool:
        """Whether a device holds one task at a time: only then can a task wait for a busy one
        (with shared devices it starts at once on a share instead)."""
        return self.max_tasks_per_device == 1

    def tables_copy(self) -> InfraGraph:
        """A graph to read while this one changes (the GNN's encoder inputs, built outside the
        daemon's lock): its tables are copies, everything else is shared, ``tasks`` included,
        which it must only look up in (a task's spec never changes, nor its devices once bound).
        Copying is a few memory copies, not a pass over the rows. Not for changing."""
        twin = copy.copy(self)
        twin.devices, twin.hosts, twin.switches = self.devices.copy(), self.hosts.copy(), self.switches.copy()
        twin.links, twin.task_table = self.links.copy(), self.task_table.copy()
        return twin

    # -- lookups ---------------------------------------------------------------------------

    def device_rows(self, device_ids: Iterable[str]) -> Rows:
        """Rows of known device ids; raises ``KeyError`` naming an unknown one."""
        index = self.devices.index
        return np.fromiter((index[d] for d in device_ids), dtype=np.int64)

    def device_ids_of(self, rows: Iterable[int]) -> list[str]:
        ids = self.devices.ids
        return [ids[r] or "" for r in rows]

    def model_of(self, row: int) -> str:
        index = int(self.devices.model[row])
        return self.model_names[index] if index >= 0 else ""

    def tasks_on_device(self, row: int) -> set[str]:
        return self._tasks_on_device.get(row, set())

    def free_memory_gb(self, rows: Rows, occupancy: Occupancy | None = None) -> NDArray[np.float64]:
        """Memory free for new tasks. Reported use may already include hlb's running tasks, so the
        larger of reserved and used counts; but tasks placed and not started yet cannot be in the
        reported use, so theirs is added to it. ``occupancy``: instead of the rows' own (the same
        shapes). Shapes: rows [N] -> [N] GB."""
        d = self.devices
        placed = d.placed_gb[rows] if occupancy is None else occupancy.placed_gb
        reserved = d.reserved_gb[rows] if occupancy is None else occupancy.reserved_gb
        used = d.memory_used_gb[rows] + placed
        free: NDArray[np.float64] = d.memory_gb[rows] - np.maximum(reserved, used)
        return free

    def load(self, rows: Rows, occupancy: Occupancy | None = None) -> NDArray[np.float64]:
        """0 (idle) .. 1 (busy): the larger of measured utilization and reserved memory share. [N] -> [N]."""
        d = self.devices
        memory = d.memory_gb[rows]
        reserved = d.reserved_gb[rows] if occupancy is None else occupancy.reserved_gb
        share = np.divide(reserved, memory, out=np.ones_like(memory), where=memory > 0)
        load: NDArray[np.float64] = np.maximum(d.utilization[rows], np.minimum(share, 1.0))
        return load

    # -- hard constraints ------------------------------------------------------------------

    def _candidate_groups(self, spec: ev.TaskSpec) -> list[tuple[int, int]]:
        kinds = set(spec.allowed_kinds)
        models = {self._model_index[m] for m in spec.allowed_models if m in self._model_index}
        return [
            group
            for group, members in self._groups.items()
            if members and (not kinds or group[0] in kinds) and (not spec.allowed_models or group[1] in models)
        ]

    def _rows_of_group(self, group: tuple[int, int]) -> Rows:
        rows = self._group_rows.get(group)
        if rows is None:
            rows = np.fromiter(sorted(self._groups[group]), dtype=np.int64)
            self._group_rows[group] = rows
        return rows

    def _rows_of_groups(self, groups: list[tuple[int, int]]) -> Rows:
        """The live rows of ``groups``, ascending; cached (a decision would otherwise sort them all).
        Not to be changed by the caller."""
        key = tuple(groups)
        rows = self._union_rows.get(key)
        if rows is None:
            rows = np.concatenate([self._rows_of_group(g) for g in groups])
            if len(groups) > 1:
                rows.sort()
            if len(self._union_rows) >= MAX_CACHED_GROUP_SETS:
                self._union_rows.clear()
            self._union_rows[key] = rows
        return rows

    def feasible_rows(self, spec: ev.TaskSpec) -> Rows:
        """Device rows that pass every hard constraint for ``spec``, ascending. Shapes: -> [F].

        Kind and model allow-lists select whole (kind, model) groups, so a task restricted to
        TPUs never looks at a GPU; health and free memory are checked vectorized in the groups.
        """
        groups = self._candidate_groups(spec)
        if not groups:
            return np.empty(0, dtype=np.int64)
        rows = self._rows_of_groups(groups)
        ok = (self.devices.health[rows] != ev.HEALTH_FAILED) & self.room(spec, rows)
        feasible: Rows = rows[ok]
        return feasible

    def busy_rows(self, spec: ev.TaskSpec, faster_models: NDArray[np.int64] | None = None) -> Rows:
        """Device rows that would pass every hard constraint for ``spec`` once the tasks on them
        end, but lack a free slot or the free memory now, and have an expected end
        (``free_at_ms``), ascending; only those of ``faster_models`` (model indices) when given.
        Shapes: -> [B]."""
        groups = self._candidate_groups(spec)
        if faster_models is not None:
            faster = set(faster_models.tolist())
            groups = [g for g in groups if g[1] in faster]
        if not groups:
            return np.empty(0, dtype=np.int64)
        rows = self._rows_of_groups(groups)
        d = self.devices
        rows = rows[(d.free_at_ms[rows] > 0) & (d.health[rows] != ev.HEALTH_FAILED)]
        busy: Rows = rows[(d.memory_gb[rows] >= spec.memory_per_device_gb) & ~self.room(spec, rows)]
        return busy

    def group_representatives(self, spec: ev.TaskSpec) -> Rows:
        """One live row of each (kind, model) group ``spec`` may run on (its allow-lists). -> [G]."""
        reps: Rows = np.array([min(self._groups[g]) for g in self._candidate_groups(spec)], dtype=np.int64)
        return reps

    def room(self, spec: ev.TaskSpec, rows: Rows, occupancy: Occupancy | None = None) -> NDArray[np.bool_]:
        """Whether each row has the free memory and a free task slot for ``spec``: the hard
        constraints that a binding can change (health, kind and model it cannot). [N] -> [N]."""
        ok: NDArray[np.bool_] = self.free_memory_gb(rows, occupancy) >= spec.memory_per_device_gb
        if self.max_tasks_per_device > 0:
            n_tasks = self.devices.n_tasks[rows] if occupancy is None else occupancy.n_tasks
            ok &= n_tasks < self.max_tasks_per_device
        return ok

    def violations(self, spec: ev.TaskSpec, rows: Rows) -> NDArray[np.int8]:
        """For each row, the index into ``CONSTRAINTS`` of the first one it breaks, or -1; a device
        with less memory in all than the task needs breaks memory before capacity. [N] -> [N]."""
        d = self.devices
        out = np.full(len(rows), -1, dtype=np.int8)
        memory = self.free_memory_gb(rows) < spec.memory_per_device_gb
        out[memory] = 4
        if self.max_tasks_per_device > 0:
            out[d.n_tasks[rows] >= self.max_tasks_per_device] = 3
        # A device too small for the task in all is ruled out by memory, whatever it runs now: the
        # reason that lasts (a busy device's slot frees up, its memory does not grow).
        out[d.memory_gb[rows] < spec.memory_per_device_gb] = 4
        if spec.allowed_models:
            models = [self._model_index[m] for m in spec.allowed_models if m in self._model_index]
            out[~np.isin(d.model[rows], models)] = 2
        if spec.allowed_kinds:
            out[~np.isin(d.kind[rows], list(spec.allowed_kinds))] = 1
        out[d.health[rows] == ev.HEALTH_FAILED] = 0
        return out

    def exclusion_counts(self, spec: ev.TaskSpec) -> Counter[str]:
        """How many live devices each hard constraint rules out for ``spec``."""
        broken = self.violations(spec, self.devices.live_rows())
        values, counts = np.unique(broken[broken >= 0], return_counts=True)
        return Counter({CONSTRAINTS[int(v)]: int(c) for v, c in zip(values, counts, strict=True)})

    def exclusions(self, spec: ev.TaskSpec, limit: int) -> list[Exclusion]:
        """Up to ``limit`` devices ruled out for ``spec``, each with the constraint and why."""
        rows = self.devices.live_rows()
        broken = self.violations(spec, rows)
        out: list[Exclusion] = []
        d = self.devices
        for i in np.flatnonzero(broken >= 0)[:limit]:
            row, constraint = int(rows[i]), CONSTRAINTS[int(broken[i])]
            if constraint == "health":
                detail = "device is failed"
            elif constraint == "kind":
                allowed = ", ".join(KIND_NAMES.get(k, str(k)) for k in spec.allowed_kinds)
                detail = f"kind {KIND_NAMES.get(int(d.kind[row]), '?')} not in allowed kinds [{allowed}]"
            elif constraint == "model":
                detail = f"model {self.model_of(row)} not in allowed models"
            elif constraint == "capacity":
                detail = f"runs {int(d.n_tasks[row])} task(s), the most a device may hold"
            elif float(d.memory_gb[row]) < spec.memory_per_device_gb:
                detail = f"{float(d.memory_gb[row]):.1f} GB in all < {spec.memory_per_device_gb:.1f} GB needed"
            else:
                free = float(self.free_memory_gb(np.array([row]))[0])
                detail = f"{free:.1f} GB free < {spec.memory_per_device_gb:.1f} GB needed"
            out.append(Exclusion(d.ids[row] or "", constraint, detail))
        return out

    # -- inventory -------------------------------------------------------------------------

    def apply_telemetry(self, event: ev.TelemetryEvent) -> None:
        """Apply one telemetry event; raise ``InvalidEventError`` (changing nothing) if it is bad."""
        kind = event.WhichOneof("payload")
        if kind is None:
            raise InvalidEventError("telemetry event without a payload", "empty")
        if kind == "device_metrics":
            self.apply_device_metrics([event.device_metrics], event.event_time_ms)
        elif kind == "metrics_batch":
            links = self._link_metric_rows(event.metrics_batch.links)  # validate all before applying any
            self.apply_device_metrics(event.metrics_batch.devices, event.event_time_ms)
            self._set_link_utilization(links, event.metrics_batch.links)
        elif kind == "link_metrics":
            self._set_link_utilization(self._link_metric_rows([event.link_metrics]), [event.link_metrics])
        else:
            self._apply_inventory(kind, event)
            self.version += 1
            self.changes += 1
        self.newest_telemetry_ms = max(self.newest_telemetry_ms, event.event_time_ms)

    def _apply_inventory(self, kind: str, event: ev.TelemetryEvent) -> None:
        if kind == "device_upsert":
            self._upsert_device(event.device_upsert)
        elif kind == "device_removed":
            self._remove_device(event.device_removed.id)
        elif kind == "host_upsert":
            self._upsert_host(event.host_upsert)
        elif kind == "host_removed":
            self._remove_host(event.host_removed.id)
        elif kind == "switch_upsert":
            self._upsert_switch(event.switch_upsert)
        elif kind == "switch_removed":
            self._remove_switch(event.switch_removed.id)
        elif kind == "link_upsert":
            self._upsert_link(event.link_upsert)
        elif kind == "link_removed":
            self.links.remove(event.link_removed.id)

    def _intern_model(self, model: str) -> int:
        index = self._model_index.get(model)
        if index is None:
            index = len(self.model_names)
            self.model_names.append(model)
            self._model_index[model] = index
        return index

    def _host_row(self, host_id: str) -> int:
        """The host's row, creating a placeholder for a host not upserted yet."""
        row = self.hosts.row(host_id)
        return self.hosts.add(host_id) if row is None else row

    def _switch_row(self, switch_id: str) -> int:
        row = self.switches.row(switch_id)
        return self.switches.add(switch_id) if row is None else row

    def _upsert_device(self, spec: ev.Device) -> None:
        _check_id(spec.id, "device")
        _check_id(spec.host_id, f"device {spec.id} host")
        in_range = (
            0.0 <= spec.memory_gb <= MAX_MEMORY_GB
            and 0.0 <= spec.peak_tflops <= 1.0e7
            and 0.0 <= spec.idle_power_w <= 1.0e5
            and 0.0 <= spec.peak_power_w <= 1.0e5
        )  # false for NaN too; the checks below then name the value (inventory loads are long)
        if not in_range:
            _check_range(spec.memory_gb, f"device {spec.id} memory_gb", 0.0, MAX_MEMORY_GB)
            _check_range(spec.peak_tflops, f"device {spec.id} peak_tflops", 0.0, 1.0e7)
            _check_range(spec.idle_power_w, f"device {spec.id} idle_power_w", 0.0, 1.0e5)
            _check_range(spec.peak_power_w, f"device {spec.id} peak_power_w", 0.0, 1.0e5)
        if spec.kind not in DEVICE_KINDS:
            raise InvalidEventError(f"device {spec.id}: unknown kind {spec.kind}", "out_of_range")
        d = self.devices
        row = d.row(spec.id)
        if row is None:
            row = d.add(spec.id)
        else:  # an update keeps what was measured and reserved; it may move group or host
            self._leave_group(row)
            if self.hosts.ids[d.host[row]] != spec.host_id:
                self._leave_host(row)
        if d.host[row] < 0 or self.hosts.ids[d.host[row]] != spec.host_id:
            host = self._host_row(spec.host_id)
            self.hosts.n_devices[host] += 1
            d.host[row] = host
        d.kind[row] = spec.kind
        d.model[row] = self._intern_model(spec.model)
        d.memory_gb[row] = spec.memory_gb
        d.peak_tflops[row] = spec.peak_tflops
        d.idle_power_w[row] = spec.idle_power_w
        d.peak_power_w[row] = spec.peak_power_w
        group = (int(spec.kind), int(d.model[row]))
        self._groups.setdefault(group, set()).add(row)
        self._group_rows.pop(group, None)
        self._union_rows.clear()

    def _leave_group(self, row: int) -> None:
        group = (int(self.devices.kind[row]), int(self.devices.model[row]))
        self._groups[group].discard(row)
        self._group_rows.pop(group, None)
        self._union_rows.clear()

    def _leave_host(self, row: int) -> None:
        host = int(self.devices.host[row])
        self.devices.host[row] = -1
        self.hosts.n_devices[host] -= 1
        if self.hosts.n_devices[host] == 0 and self.hosts.placeholder[host]:
            self._drop_links(HOST_NODE, np.array([host]))
            self.hosts.remove(self.hosts.ids[host] or "")

    def _remove_device(self, device_id: str) -> None:
        row = self.devices.row(device_id)
        if row is None:
            return  # removing twice is harmless (replays)
        if self.devices.n_tasks[row]:
            busy = sorted(self.tasks_on_device(row))
            raise InvalidEventError(f"device {device_id} still runs tasks {busy}", "in_use")
        self._drop_device(row)

    def _drop_device(self, row: int) -> None:
        self._drop_links(DEVICE_NODE, np.array([row]))
        self._leave_group(row)
        self._leave_host(row)
        self.devices.remove(self.devices.ids[row] or "")

    def _upsert_host(self, spec: ev.Host) -> None:
        _check_id(spec.id, "host")
        if spec.rack_id:
            _check_id(spec.rack_id, f"host {spec.id} rack")
        _check_range(spec.cpu_cores, f"host {spec.id} cpu_cores", 0.0, 1.0e6)
        _check_range(spec.memory_gb, f"host {spec.id} memory_gb", 0.0, MAX_MEMORY_GB)
        h = self.hosts
        row = self._host_row(spec.id)
        if h.rack[row] >= 0:
            self.switches.n_children[h.rack[row]] -= 1
        h.rack[row] = self._switch_row(spec.rack_id) if spec.rack_id else -1
        if h.rack[row] >= 0:
            self.switches.n_children[h.rack[row]] += 1
        h.cpu_cores[row] = spec.cpu_cores
        h.memory_gb[row] = spec.memory_gb
        h.placeholder[row] = False

    def _remove_host(self, host_id: str) -> None:
        row = self.hosts.row(host_id)
        if row is None:
            return
        d = self.devices
        on_host = np.flatnonzero(d.alive & (d.host == row))
        busy = [d.ids[r] for r in on_host if d.n_tasks[r]]
        if busy:
            raise InvalidEventError(f"host {host_id} has busy devices {busy}", "in_use")
        self.hosts.placeholder[row] = False  # dropping its last device must not remove it twice
        for device_row in on_host:
            self._drop_device(int(device_row))
        self._drop_links(HOST_NODE, np.array([row]))
        if self.hosts.rack[row] >= 0:
            self.switches.n_children[self.hosts.rack[row]] -= 1
        self.hosts.remove(host_id)

    def _upsert_switch(self, spec: ev.Switch) -> None:
        _check_id(spec.id, "switch")
        if spec.parent_id == spec.id:
            raise InvalidEventError(f"switch {spec.id} is its own parent", "cycle")
        s = self.switches
        ancestor = s.row(spec.parent_id) if spec.parent_id else None
        while ancestor is not None and ancestor >= 0:  # the switch tree must stay a tree
            if s.ids[ancestor] == spec.id:
                raise InvalidEventError(f"switch {spec.id}: parent {spec.parent_id} is below it", "cycle")
            ancestor = int(s.parent[ancestor])
        row = self._switch_row(spec.id)
        parent = self._switch_row(spec.parent_id) if spec.parent_id else -1
        if s.parent[row] >= 0:
            s.n_children[s.parent[row]] -= 1
        s.parent[row] = parent
        if parent >= 0:
            s.n_children[parent] += 1
        s.placeholder[row] = False

    def _remove_switch(self, switch_id: str) -> None:
        row = self.switches.row(switch_id)
        if row is None:
            return
        if self.switches.n_children[row]:
            raise InvalidEventError(f"switch {switch_id} still has hosts or switches below it", "in_use")
        self._drop_links(SWITCH_NODE, np.array([row]))
        if self.switches.parent[row] >= 0:
            self.switches.n_children[self.switches.parent[row]] -= 1
        self.switches.remove(switch_id)

    def _endpoint(self, node_id: str, what: str) -> tuple[int, int]:
        for node_type, table in ((DEVICE_NODE, self.devices), (HOST_NODE, self.hosts), (SWITCH_NODE, self.switches)):
            row = table.row(node_id)
            if row is not None:
                return node_type, row
        raise InvalidEventError(f"{what} names unknown device, host or switch {node_id!r}", "unknown_id")

    def _upsert_link(self, link: ev.Link) -> None:
        _check_id(link.id, "link")
        _check_id(link.src_id, f"link {link.id} src")
        _check_id(link.dst_id, f"link {link.id} dst")
        _check_range(link.bandwidth_gbps, f"link {link.id} bandwidth_gbps", 0.0, 1.0e6)
        _check_range(link.latency_us, f"link {link.id} latency_us", 0.0, 1.0e9)
        if link.kind not in ev.LinkKind.values():
            raise InvalidEventError(f"link {link.id}: unknown kind {link.kind}", "out_of_range")
        src_type, src = self._endpoint(link.src_id, f"link {link.id} src")
        dst_type, dst = self._endpoint(link.dst_id, f"link {link.id} dst")
        t = self.links
        row = t.row(link.id)
        if row is None:
            row = t.add(link.id)
        t.src_type[row], t.src[row], t.dst_type[row], t.dst[row] = src_type, src, dst_type, dst
        t.kind[row] = link.kind
        t.bandwidth_gbps[row] = link.bandwidth_gbps
        t.latency_us[row] = link.latency_us

    def _drop_links(self, node_type: int, rows: Rows) -> None:
        t = self.links
        touching = t.alive & (
            ((t.src_type == node_type) & np.isin(t.src, rows)) | ((t.dst_type == node_type) & np.isin(t.dst, rows))
        )
        for row in np.flatnonzero(touching):
            t.remove(t.ids[row] or "")

    # -- metrics ---------------------------------------------------------------------------

    def apply_device_metrics(self, metrics: Sequence[ev.DeviceMetrics], event_time_ms: int = 0) -> None:
        """Apply metrics of many devices at once: all are validated before any is applied."""
        if not metrics:
            return
        ids = [m.device_id for m in metrics]
        index = self.devices.index
        try:
            rows = np.fromiter((index[i] for i in ids), dtype=np.int64, count=len(ids))
        except KeyError as missing:
            raise InvalidEventError(f"metrics for unknown device {missing.args[0]!r}", "unknown_id") from None
        count = len(ids)
        util = np.fromiter((m.utilization for m in metrics), dtype=np.float64, count=count)
        used = np.fromiter((m.memory_used_gb for m in metrics), dtype=np.float64, count=count)
        power = np.fromiter((m.power_w for m in metrics), dtype=np.float64, count=count)
        temp = np.fromiter((m.temperature_c for m in metrics), dtype=np.float64, count=count)
        health = np.fromiter((m.health for m in metrics), dtype=np.int64, count=count)
        self.apply_metrics_arrays(rows, util, used, power, temp, health, ids, event_time_ms)

    def apply_metrics_arrays(
        self,
        rows: Rows,
        utilization: NDArray[np.float64],
        memory_used_gb: NDArray[np.float64],
        power_w: NDArray[np.float64],
        temperature_c: NDArray[np.float64],
        health: NDArray[np.int64],
        ids: Sequence[str],
        event_time_ms: int = 0,
    ) -> None:
        """Validate then apply one report per row. Shapes: every array [N]; ``ids`` names rows in errors.

        A health of HEALTH_UNSPECIFIED keeps the device's current health. When a row appears
        twice, the later report wins.
        """
        d = self.devices
        _check_ranges(utilization, ids, "utilization", 0.0, 1.0)
        _check_ranges(memory_used_gb, ids, "memory_used_gb", 0.0, d.memory_gb[rows])
        _check_ranges(power_w, ids, "power_w", 0.0, 1.0e5)
        _check_ranges(temperature_c, ids, "temperature_c", -100.0, 400.0)
        bad = (health < 0) | (health > MAX_HEALTH)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidEventError(f"device {ids[i]}: unknown health {int(health[i])}", "out_of_range")
        d.utilization[rows] = utilization
        d.memory_used_gb[rows] = memory_used_gb
        d.power_w[rows] = power_w
        d.temperature_c[rows] = temperature_c
        known = health != ev.HEALTH_UNSPECIFIED
        d.health[rows[known]] = health[known]
        if event_time_ms:
            d.metrics_ms[rows] = event_time_ms
        self.metrics_version += 1
        self.changes += len(rows)

    def _link_metric_rows(self, metrics: Sequence[ev.LinkMetrics]) -> list[int]:
        """Rows of the links ``metrics`` report on, after checking each report."""
        rows = []
        for m in metrics:
            row = self.links.row(m.link_id)
            if row is None:
                raise InvalidEventError(f"metrics for unknown link {m.link_id!r}", "unknown_id")
            _check_range(m.utilization, f"link {m.link_id} utilization", 0.0, 1.0)
            rows.append(row)
        return rows

    def _set_link_utilization(self, rows: list[int], metrics: Sequence[ev.LinkMetrics]) -> None:
        for row, m in zip(rows, metrics, strict=True):
            self.links.utilization[row] = m.utilization

    # -- tasks -----------------------------------------------------------------------------

    def add_task(self, spec: ev.TaskSpec, cell: str, *, checked: bool = False, plain: bool = False) -> Task:
        """Record a submitted task (validated); a replay of the same submission returns it unchanged.

        ``checked``: the caller has already passed ``spec`` through ``check_task_spec`` (or
        ``check_task_specs``), so it is not checked twice. ``plain``: ``check_task_specs`` found
        that it names no lists (``Task.plain``).
        """
        if not checked:
            check_task_spec(spec)
        task_id = spec.id
        known = self.tasks.get(task_id)
        if known is not None:
            if known.spec != spec:
                raise InvalidEventError(f"task {task_id} was already submitted with another spec", "duplicate_id")
            return known
        if not plain:
            self._check_no_cycle(spec)
        self._arrivals += 1
        task = Task(spec=spec, cell=cell, arrival=self._arrivals, plain=plain)
        task.row = self.task_table.add(task_id)
        self.task_table.describe(task.row, spec, task.arrival, plain)
        self.tasks[task_id] = task
        return task

    def describe_tasks(self) -> None:
        """Fill the task table's columns of every live task from the tasks (a restored snapshot
        written before some columns existed); a device row counts only while it holds that device."""
        t, ids = self.task_table, self.devices.ids
        for task in self.tasks.values():
            if task.row < 0:
                continue
            t.describe(task.row, task.spec, task.arrival)
            t.state[task.row] = task.state
            if task.state.holds_devices:
                held = [
                    r
                    for r, d in zip(task.device_rows, task.device_ids, strict=True)
                    if 0 <= r < len(ids) and ids[r] == d
                ]
                t.hold(task.row, held)

    def _check_no_cycle(self, spec: ev.TaskSpec) -> None:
        """Refuse a task that closes a dependency cycle: a known task it (transitively) needs needs it."""
        if not spec.dependencies:
            return
        seen: set[str] = set()
        stack = [dep.task_id for dep in spec.dependencies]
        while stack:
            task_id = stack.pop()
            if task_id == spec.id:
                raise InvalidEventError(f"task {spec.id}: its dependencies lead back to it", "cycle")
            upstream = self.tasks.get(task_id)
            if task_id in seen or upstream is None:
                continue
            seen.add(task_id)
            stack.extend(dep.task_id for dep in upstream.spec.dependencies)

    def bind(self, task: Task, rows: Sequence[int], device_ids: Sequence[str] | None = None) -> None:
        """Reserve the task's memory on each of its devices (rows of live devices; ``device_ids``:
        their ids, when the caller has them already)."""
        d = self.devices
        memory, task_id = task.spec.memory_per_device_gb, task.spec.id
        on_device = self._tasks_on_device
        task.device_rows = held = tuple(map(int, rows))
        for row in held:
            d.reserved_gb[row] += memory
            d.placed_gb[row] += memory
            d.n_tasks[row] += 1
            on_device.setdefault(row, set()).add(task_id)
        task.device_ids = tuple(self.device_ids_of(held) if device_ids is None else device_ids)
        if task.row >= 0:
            self.task_table.hold(task.row, task.device_rows)
        self._set_state(task, TaskState.PLACED)
        self.changes += len(rows)

    def mark_running(self, task: Task) -> None:
        if task.state == TaskState.PLACED:
            self._unplace(task)
        self._set_state(task, TaskState.RUNNING)

    def _unplace(self, task: Task) -> None:
        """The task's memory is no longer 'placed, not started' on its devices."""
        d = self.devices
        for row, device_id in zip(task.device_rows, task.device_ids, strict=True):
            if d.ids[row] == device_id:
                d.placed_gb[row] = max(0.0, d.placed_gb[row] - task.spec.memory_per_device_gb)

    def release(self, task: Task, final_state: TaskState) -> None:
        """Return the task's reservations and move it to a final state.

        A device the task ran on reads as its last report less the task until the next report
        comes: the report counted the task's memory, and, once no task hlb placed is left on the
        device, its utilization was the task's (a device freed between reports otherwise looks
        busy for up to a telemetry interval, and a gang ready for a fast host that just emptied
        would take slow devices instead)."""
        d = self.devices
        ran = task.state == TaskState.RUNNING
        if task.state == TaskState.PLACED:
            self._unplace(task)
        memory = task.spec.memory_per_device_gb
        for row, device_id in zip(task.device_rows, task.device_ids, strict=True):
            if d.ids[row] == device_id and task.spec.id in self._tasks_on_device.get(row, ()):
                self._tasks_on_device[row].discard(task.spec.id)
                if not self._tasks_on_device[row]:
                    del self._tasks_on_device[row]
                d.n_tasks[row] -= 1
                d.reserved_gb[row] = max(0.0, d.reserved_gb[row] - memory)
                if ran:
                    d.memory_used_gb[row] = max(0.0, d.memory_used_gb[row] - memory)
                    if d.n_tasks[row] == 0:
                        d.utilization[row] = 0.0
        self._set_state(task, final_state)
        self.changes += len(task.device_rows)

    def _set_state(self, task: Task, state: TaskState) -> None:
        task.state = state
        if task.row >= 0:
            if state in FINAL_STATES:
                self.task_table.remove(task.spec.id)
                task.row = -1
            else:
                self.task_table.state[task.row] = state

    def nbytes(self) -> int:
        """Bytes held by the numpy columns of every table."""
        tables = (self.devices, self.hosts, self.switches, self.links, self.task_table)
        return sum(t.nbytes() for t in tables)


def check_task_spec(spec: ev.TaskSpec) -> None:
    """Raise ``InvalidEventError`` naming the field when a task spec is out of range."""
    _check_id(spec.id, "task")
    if spec.num_devices > MAX_GANG:
        raise InvalidEventError(f"task {spec.id}: num_devices={spec.num_devices} exceeds {MAX_GANG}", "out_of_range")
    _check_range(spec.memory_per_device_gb, f"task {spec.id} memory_per_device_gb", 0.0, MAX_MEMORY_GB)
    _check_range(spec.work_ref_s, f"task {spec.id} work_ref_s", 0.0, 1.0e10)
    _check_range(spec.latency_slo_ms, f"task {spec.id} latency_slo_ms", 0.0, 1.0e9)
    if spec.kind not in TASK_KINDS:
        raise InvalidEventError(f"task {spec.id}: unknown kind {spec.kind}", "out_of_range")
    for kind in spec.allowed_kinds:
        if kind not in DEVICE_KINDS:
            raise InvalidEventError(f"task {spec.id}: unknown allowed kind {kind}", "out_of_range")
    for label in SERVICE_LOAD_LABELS:
        if label in spec.labels:
            _check_label_number(spec, label)
    for dep in spec.dependencies:
        if dep.task_id == spec.id:
            raise InvalidEventError(f"task {spec.id} depends on itself", "cycle")
        _check_id(dep.task_id, f"task {spec.id} dependency")
        _check_range(dep.transfer_gb, f"task {spec.id} dependency transfer_gb", 0.0, MAX_MEMORY_GB)


def _check_label_number(spec: ev.TaskSpec, label: str) -> None:
    text = spec.labels[label]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 < value <= 1.0e9):
        raise InvalidEventError(f"task {spec.id}: label {label}={text!r} is not a number in (0, 1e9]", "out_of_range")


def check_task_specs(specs: Sequence[ev.TaskSpec]) -> list[bool]:
    """``check_task_spec`` for many specs at once: raises for the first bad one (lowest index) with
    ``tasks[i]: `` before the message, exactly as checking them one by one in order would. Returns
    for each spec whether it is plain (``Task.plain``: no dependencies, allowed kinds or models,
    preferred models or labels).

    The numeric ranges are checked vectorized; only a spec that fails one, or that has lists to
    check (allowed kinds, dependencies) or an id of unusual length, goes through the full check.
    """
    n = len(specs)
    if not n:
        return []
    memory = np.fromiter((s.memory_per_device_gb for s in specs), dtype=np.float64, count=n)
    work = np.fromiter((s.work_ref_s for s in specs), dtype=np.float64, count=n)
    slo = np.fromiter((s.latency_slo_ms for s in specs), dtype=np.float64, count=n)
    gang = np.fromiter((s.num_devices for s in specs), dtype=np.int64, count=n)
    bad = ~(np.isfinite(memory) & (memory >= 0.0) & (memory <= MAX_MEMORY_GB))
    bad |= ~(np.isfinite(work) & (work >= 0.0) & (work <= 1.0e10))
    bad |= ~(np.isfinite(slo) & (slo >= 0.0) & (slo <= 1.0e9))
    bad |= gang > MAX_GANG
    kinds = TASK_KINDS
    plain = [False] * n
    for i, spec in enumerate(specs):
        checked_lists = len(spec.allowed_kinds) or len(spec.dependencies)
        labels = spec.labels
        if (
            not 0 < len(spec.id) <= MAX_ID_CHARS
            or spec.kind not in kinds
            or checked_lists
            or (labels and any(label in labels for label in SERVICE_LOAD_LABELS))
        ):
            bad[i] = True
        elif not labels and not len(spec.allowed_models) and not len(spec.preferred_models):
            plain[i] = True
    for index in np.flatnonzero(bad).tolist():
        try:
            check_task_spec(specs[index])
        except InvalidEventError as exc:
            raise InvalidEventError(f"tasks[{index}]: {exc}", exc.reason) from None
    return plain
