"""The graph's tables: each node and edge type a struct of numpy arrays indexed by row.

A :class:`Table` holds an id map, a free list and numpy columns of one length. Adding, changing
and removing an entity is O(1) amortized (rows are reused, arrays grow by doubling); row numbers
are stable while an entity lives, so features and policies work on row arrays. References between
tables are rows: a device names its host row, a host its rack (switch) row, a link its endpoints'.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar, Self, overload

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

Rows = NDArray[np.int64]

# Endpoint types of a link (``LinkTable.src_type`` / ``dst_type``).
DEVICE_NODE, HOST_NODE, SWITCH_NODE = 0, 1, 2


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

    def subset(self, rows: Rows) -> Self:
        """An independent, compact copy of the live ``rows`` only: row ``i`` of the copy is
        ``rows[i]`` here, with its id and columns; no free row."""
        twin = copy.copy(self)
        twin.ids = [self.ids[r] for r in rows.tolist()]
        twin.index = {entity_id: i for i, entity_id in enumerate(twin.ids) if entity_id is not None}
        twin._free = []
        twin.alive = self.alive[rows]
        for name in self.COLUMNS:
            setattr(twin, name, getattr(self, name)[rows])
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
        # Fractional use (docs/fractional.md). ``share_capacity``: milli-devices the device holds in
        # all (a shareable one's declared capacity, a partition's compute share, else 1000);
        # ``share_used``: those held now (a share, a partition or a shareable device taken whole);
        # ``parent``: a partition's physical device (a row; -1: not known yet, or none);
        # ``busy_partitions``: a parent's partitions that hold a task.
        "sharing": (np.int8, 0),  # ev.DeviceSharing; 0: exclusive
        "partition": (np.bool_, False),
        "share_capacity": (np.int32, 1000),
        "share_used": (np.int32, 0),
        "parent": (np.int32, -1),
        "busy_partitions": (np.int32, 0),
    }
    # At their defaults in a snapshot written before them: 0 until the next placement there (the
    # expected end), an exclusive whole device (the sharing columns).
    LATER_COLUMNS: ClassVar[frozenset[str]] = frozenset(
        {"free_at_ms", "sharing", "partition", "share_capacity", "share_used", "parent", "busy_partitions"}
    )
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
    sharing: NDArray[np.int8]
    partition: NDArray[np.bool_]
    share_capacity: NDArray[np.int32]
    share_used: NDArray[np.int32]
    parent: NDArray[np.int32]
    busy_partitions: NDArray[np.int32]


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


class RowIds(Sequence[str]):
    """The ids of ``rows`` of ``ids`` ("" for a free row), looked up only when read: an error
    message names devices, and building the list for thousands of rows per report costs more than
    the rest of applying it."""

    def __init__(self, ids: Sequence[str | None], rows: Rows) -> None:
        self._ids = ids
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._ids[r] or "" for r in self._rows[i].tolist()]
        return self._ids[int(self._rows[i])] or ""
