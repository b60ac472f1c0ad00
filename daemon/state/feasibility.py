"""The hard constraints: which devices a task may be placed on now, and why the others may not.

A device passes when it is not failed, its kind and model are in the task's allow-lists (when
it names them), and it has the free memory and a free task slot, or for a task that asks for a
share of a device, the free share (``room``; docs/fractional.md). The filter keeps
the live device rows by (kind, model) group, so that an allow-list selects whole groups (a task
restricted to TPUs never looks at a GPU) and the rest is checked vectorized within them.

The filter owns that group index, which the graph keeps up to date as devices come, change and
go; everything else it reads from the graph it is given (:class:`GraphView`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.tables import DeviceTable, Rows
from hlb.v1 import events_pb2 as ev

MAX_CACHED_GROUP_SETS = 64  # allow-list combinations whose rows a graph keeps sorted
CONSTRAINTS = ("health", "kind", "model", "capacity", "memory", "share")
KIND_NAMES: dict[int, str] = {
    int(value): name.removeprefix("DEVICE_KIND_").lower() for name, value in ev.DeviceKind.items()
}

Group = tuple[int, int]  # (device kind, model index)


class GraphView(Protocol):
    """What the filter reads of the graph (``InfraGraph``)."""

    devices: DeviceTable
    max_tasks_per_device: int  # 0: no limit
    partitions: dict[str, tuple[str, str]]  # a partition's id -> (its parent's id, its profile)
    shared_devices: int  # live devices that are shareable or partitions (0: every rule of sharing holds)

    def model_numbers(self, models: Iterable[str]) -> list[int]: ...

    def model_of(self, row: int) -> str: ...

    def free_memory_gb(self, rows: Rows, occupancy: Occupancy | None = None) -> NDArray[np.float64]: ...


@dataclass(frozen=True)
class Exclusion:
    """A device ruled out for a task: which hard constraint (a short name) and the detail in words."""

    device_id: str
    constraint: str  # one of CONSTRAINTS
    detail: str


@dataclass(frozen=True)
class Occupancy:
    """What a binding changes on devices: tasks held, memory reserved, memory placed and not started,
    and the share held (milli-devices).

    The graph's own values (:meth:`of`), or those after more bindings (:meth:`after`), so that a
    policy can score a device as it will be once more tasks are bound to it, with the same
    arithmetic as :meth:`InfraGraph.bind` (one addition per binding: the floats are the same).
    Shapes: [N] each, aligned with the rows they were read for.
    """

    n_tasks: NDArray[np.int32]
    reserved_gb: NDArray[np.float64]
    placed_gb: NDArray[np.float64]
    share_used: NDArray[np.int32]

    @classmethod
    def of(cls, graph: GraphView, rows: Rows) -> Occupancy:
        d = graph.devices
        return cls(d.n_tasks[rows], d.reserved_gb[rows], d.placed_gb[rows], d.share_used[rows])

    def after(self, memory_gb: float, share_milli: NDArray[np.int32] | int = 0) -> Occupancy:
        """One more task of ``memory_gb`` on every row, holding ``share_milli`` there (per row, as
        :func:`share_charge` gives it), as ``bind`` adds it."""
        return Occupancy(
            self.n_tasks + 1, self.reserved_gb + memory_gb, self.placed_gb + memory_gb, self.share_used + share_milli
        )

    @staticmethod
    def concat(parts: Sequence[Occupancy]) -> Occupancy:
        return Occupancy(
            np.concatenate([p.n_tasks for p in parts]),
            np.concatenate([p.reserved_gb for p in parts]),
            np.concatenate([p.placed_gb for p in parts]),
            np.concatenate([p.share_used for p in parts]),
        )


def share_charge(devices: DeviceTable, share_milli: int, rows: Rows) -> NDArray[np.int32]:
    """The share (milli-devices) a task that asks for ``share_milli`` (0: whole devices) holds on
    each row once bound there: its share on a shareable device, all of a partition, all of a
    shareable device taken whole, nothing on an exclusive device (counted by ``n_tasks``). [N] -> [N]."""
    if share_milli:
        charge = np.where(devices.partition[rows], devices.share_capacity[rows], share_milli)
    else:
        charge = np.where(devices.sharing[rows] > 0, devices.share_capacity[rows], 0)
    return charge.astype(np.int32)


def share_fits(
    devices: DeviceTable, share_milli: int, rows: Rows, share_used: NDArray[np.int32] | None = None
) -> NDArray[np.bool_]:
    """Whether each row can take a task asking for ``share_milli`` (0: a whole device) by the
    sharing rules (docs/fractional.md), memory and task slots apart: a share on a shareable device
    with that much free or on a free partition at least that large whose parent holds no task; a
    whole device that is no partition, none of whose partitions holds a task, and, shareable,
    holds no share. ``share_used``: instead of the rows' own. [N] -> [N]."""
    d = devices
    used = d.share_used[rows] if share_used is None else share_used
    capacity = d.share_capacity[rows]
    partition = d.partition[rows]
    if share_milli:
        parent = d.parent[rows]
        parent_busy = (parent >= 0) & (d.n_tasks[np.maximum(parent, 0)] > 0)
        on_partition = partition & (used == 0) & (capacity >= share_milli) & ~parent_busy
        ok: NDArray[np.bool_] = ((d.sharing[rows] > 0) & (capacity - used >= share_milli)) | on_partition
        return ok
    whole: NDArray[np.bool_] = ~partition & (d.busy_partitions[rows] == 0) & ((d.sharing[rows] == 0) | (used == 0))
    return whole


class FeasibilityFilter:
    """The hard-constraint filter of one graph, with its index of live device rows by group."""

    def __init__(self) -> None:
        # (kind, model index) -> live device rows; the cached arrays are rebuilt lazily per group.
        self._groups: dict[Group, set[int]] = {}
        self._group_rows: dict[Group, Rows] = {}
        # The same for the groups a task may use together (most tasks: every group), ascending.
        self._union_rows: dict[tuple[Group, ...], Rows] = {}

    # -- the group index -------------------------------------------------------------------

    def join(self, row: int, kind: int, model: int) -> None:
        """Device ``row`` is now of ``kind`` and model index ``model``."""
        group = (kind, model)
        self._groups.setdefault(group, set()).add(row)
        self._group_rows.pop(group, None)
        self._union_rows.clear()

    def leave(self, row: int, kind: int, model: int) -> None:
        """Device ``row`` is no longer of ``kind`` and ``model`` (it changes or goes)."""
        group = (kind, model)
        self._groups[group].discard(row)
        self._group_rows.pop(group, None)
        self._union_rows.clear()

    def regroup(self, devices: DeviceTable) -> None:
        """Index every live row of ``devices`` (a table restored in place of the graph's)."""
        for row in devices.index.values():
            self._groups.setdefault((int(devices.kind[row]), int(devices.model[row])), set()).add(row)

    def _candidate_groups(self, graph: GraphView, spec: ev.TaskSpec) -> list[Group]:
        kinds = set(spec.allowed_kinds)
        models = set(graph.model_numbers(spec.allowed_models))
        return [
            group
            for group, members in self._groups.items()
            if members and (not kinds or group[0] in kinds) and (not spec.allowed_models or group[1] in models)
        ]

    def _rows_of_group(self, group: Group) -> Rows:
        rows = self._group_rows.get(group)
        if rows is None:
            rows = np.fromiter(sorted(self._groups[group]), dtype=np.int64)
            self._group_rows[group] = rows
        return rows

    def _rows_of_groups(self, groups: list[Group]) -> Rows:
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

    # -- the constraints -------------------------------------------------------------------

    def feasible_rows(self, graph: GraphView, spec: ev.TaskSpec) -> Rows:
        """Device rows that pass every hard constraint for ``spec``, ascending. Shapes: -> [F].

        Kind and model allow-lists select whole (kind, model) groups; health and free memory are
        checked vectorized in the groups.
        """
        groups = self._candidate_groups(graph, spec)
        if not groups:
            return np.empty(0, dtype=np.int64)
        rows = self._rows_of_groups(groups)
        ok = (graph.devices.health[rows] != ev.HEALTH_FAILED) & self.room(graph, spec, rows)
        feasible: Rows = rows[ok]
        return feasible

    def busy_rows(self, graph: GraphView, spec: ev.TaskSpec, faster_models: NDArray[np.int64] | None = None) -> Rows:
        """Device rows that would pass every hard constraint for ``spec`` once the tasks on them
        end, but lack a free slot or the free memory now, and have an expected end
        (``free_at_ms``), ascending; only those of ``faster_models`` (model indices) when given.
        None for a task that asks for a share; never a partition, a shareable device or a parent
        whose partitions hold tasks (their expected ends say when one share frees, not the device).
        Shapes: -> [B]."""
        if spec.device_share_milli:  # a share never waits for a busy device: it is placed where one is free
            return np.empty(0, dtype=np.int64)
        groups = self._candidate_groups(graph, spec)
        if faster_models is not None:
            faster = set(faster_models.tolist())
            groups = [g for g in groups if g[1] in faster]
        if not groups:
            return np.empty(0, dtype=np.int64)
        rows = self._rows_of_groups(groups)
        d = graph.devices
        waitable = (d.free_at_ms[rows] > 0) & (d.health[rows] != ev.HEALTH_FAILED)
        if graph.shared_devices:  # a whole-device task waits for exclusive devices only, as before shares
            waitable &= ~d.partition[rows] & (d.sharing[rows] == 0) & (d.busy_partitions[rows] == 0)
        rows = rows[waitable]
        busy: Rows = rows[(d.memory_gb[rows] >= spec.memory_per_device_gb) & ~self.room(graph, spec, rows)]
        return busy

    def representatives(self) -> dict[Group, int]:
        """Each (kind, model) group's lowest live row, the one :meth:`group_representatives` gives,
        for every group with a device."""
        return {group: min(rows) for group, rows in self._groups.items() if rows}

    def group_representatives(self, graph: GraphView, spec: ev.TaskSpec) -> Rows:
        """One live row of each (kind, model) group ``spec`` may run on (its allow-lists). -> [G]."""
        groups = self._candidate_groups(graph, spec)
        reps: Rows = np.array([min(self._groups[g]) for g in groups], dtype=np.int64)
        return reps

    def room(
        self, graph: GraphView, spec: ev.TaskSpec, rows: Rows, occupancy: Occupancy | None = None
    ) -> NDArray[np.bool_]:
        """Whether each row has the free memory and a free task slot for ``spec``: the hard
        constraints that a binding can change (health, kind and model it cannot). [N] -> [N]."""
        ok: NDArray[np.bool_] = graph.free_memory_gb(rows, occupancy) >= spec.memory_per_device_gb
        share = spec.device_share_milli
        limit = graph.max_tasks_per_device
        if limit > 0 and not share:  # the count limits whole-device tasks on exclusive devices
            n_tasks = graph.devices.n_tasks[rows] if occupancy is None else occupancy.n_tasks
            under = n_tasks < limit
            if graph.shared_devices:
                under |= graph.devices.sharing[rows] > 0
            ok &= under
        if graph.shared_devices:
            ok &= share_fits(graph.devices, share, rows, None if occupancy is None else occupancy.share_used)
        elif share:
            ok[:] = False  # no shareable device, no partition
        return ok

    def violations(self, graph: GraphView, spec: ev.TaskSpec, rows: Rows) -> NDArray[np.int8]:
        """For each row, the index into ``CONSTRAINTS`` of the first one it breaks, or -1; a device
        with less memory in all than the task needs breaks memory before capacity. [N] -> [N]."""
        d = graph.devices
        out = np.full(len(rows), -1, dtype=np.int8)
        memory = graph.free_memory_gb(rows) < spec.memory_per_device_gb
        out[memory] = 4
        share = spec.device_share_milli
        if graph.max_tasks_per_device > 0 and not share:
            full = d.n_tasks[rows] >= graph.max_tasks_per_device
            out[full & (d.sharing[rows] == 0) if graph.shared_devices else full] = 3
        if share or graph.shared_devices:
            out[~share_fits(d, share, rows)] = 5
        # A device too small for the task in all is ruled out by memory, whatever it runs now: the
        # reason that lasts (a busy device's slot frees up, its memory does not grow).
        out[d.memory_gb[rows] < spec.memory_per_device_gb] = 4
        if spec.allowed_models:
            out[~np.isin(d.model[rows], graph.model_numbers(spec.allowed_models))] = 2
        if spec.allowed_kinds:
            out[~np.isin(d.kind[rows], list(spec.allowed_kinds))] = 1
        out[d.health[rows] == ev.HEALTH_FAILED] = 0
        return out

    def exclusion_counts(self, graph: GraphView, spec: ev.TaskSpec) -> Counter[str]:
        """How many live devices each hard constraint rules out for ``spec``."""
        broken = self.violations(graph, spec, graph.devices.live_rows())
        values, counts = np.unique(broken[broken >= 0], return_counts=True)
        return Counter({CONSTRAINTS[int(v)]: int(c) for v, c in zip(values, counts, strict=True)})

    def exclusions(self, graph: GraphView, spec: ev.TaskSpec, limit: int) -> list[Exclusion]:
        """Up to ``limit`` devices ruled out for ``spec``, each with the constraint and why."""
        d = graph.devices
        rows = d.live_rows()
        broken = self.violations(graph, spec, rows)
        out: list[Exclusion] = []
        for i in np.flatnonzero(broken >= 0)[:limit]:
            row, constraint = int(rows[i]), CONSTRAINTS[int(broken[i])]
            if constraint == "health":
                detail = "device is failed"
            elif constraint == "kind":
                allowed = ", ".join(KIND_NAMES.get(k, str(k)) for k in spec.allowed_kinds)
                detail = f"kind {KIND_NAMES.get(int(d.kind[row]), '?')} not in allowed kinds [{allowed}]"
            elif constraint == "model":
                detail = f"model {graph.model_of(row)} not in allowed models"
            elif constraint == "capacity":
                detail = f"runs {int(d.n_tasks[row])} task(s), the most a device may hold"
            elif constraint == "share":
                detail = _share_detail(graph, spec.device_share_milli, row)
            elif float(d.memory_gb[row]) < spec.memory_per_device_gb:
                detail = f"{float(d.memory_gb[row]):.1f} GB in all < {spec.memory_per_device_gb:.1f} GB needed"
            else:
                free = float(graph.free_memory_gb(np.array([row]))[0])
                detail = f"{free:.1f} GB free < {spec.memory_per_device_gb:.1f} GB needed"
            out.append(Exclusion(d.ids[row] or "", constraint, detail))
        return out


def _share_detail(graph: GraphView, share_milli: int, row: int) -> str:
    """Why device ``row`` cannot take a task asking for ``share_milli`` (0: a whole device) by the
    sharing rules (:func:`share_fits`), in words."""
    d = graph.devices
    used, capacity = int(d.share_used[row]), int(d.share_capacity[row])
    if d.partition[row]:
        parent_id, profile = graph.partitions.get(d.ids[row] or "", ("", ""))
        what = f"partition {profile} of {parent_id}" if profile else f"partition of {parent_id}"
        if not share_milli:
            return f"{what}: partitions take tasks that ask for a share"
        if used:
            return f"{what} holds a task"
        if capacity < share_milli:
            return f"{what}: compute share {capacity} milli < {share_milli} needed"
        return f"{what}: its parent holds a whole-device task"
    if share_milli:
        if not d.sharing[row]:
            return "exclusive device: a share needs a shareable device or a partition"
        return f"{capacity - used} of {capacity} milli free < {share_milli} needed"
    if d.busy_partitions[row]:
        return f"{int(d.busy_partitions[row])} of its partitions hold tasks"
    return f"{used} of {capacity} milli held by shares: a whole-device task needs all of it"
