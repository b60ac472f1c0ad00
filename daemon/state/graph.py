"""The daemon's picture of the infrastructure: devices, hosts, switches, links and tasks.

:class:`InfraGraph` holds one :class:`~hlb.daemon.state.tables.Table` per node and edge type and
keeps them consistent as events arrive: inventory (upserts and removals, with placeholders for a
host or rack named before its own upsert), telemetry (a batch of metrics applied vectorized), and
the task lifecycle (submitted, bound to devices, running, ended). Nothing is ever rebuilt per
event. Each event is checked (``hlb.daemon.state.checks``) before anything changes; the hard
constraints a placement must meet are the graph's ``FeasibilityFilter``'s. Pure: no I/O, no
clock; callers pass event times in.

The module is about 550 lines, nearly all of them InfraGraph's: inventory, telemetry and the
task lifecycle change the same tables and counters (``version``, ``changes``), so a split would
have each part write the others' columns.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.errors import InvalidEventError
from hlb.daemon.state.checks import (
    WHOLE_SHARE,
    check_device,
    check_device_metrics,
    check_host,
    check_id,
    check_link,
    check_range,
    check_task_spec,
    dependency_cycle,
)
from hlb.daemon.state.feasibility import Exclusion, FeasibilityFilter, Occupancy, share_charge
from hlb.daemon.state.tables import (
    DEVICE_NODE,
    HOST_NODE,
    SWITCH_NODE,
    DeviceTable,
    HostTable,
    LinkTable,
    Rows,
    SwitchTable,
    TaskTable,
)
from hlb.daemon.state.task import FINAL_STATES, Task, TaskState
from hlb.v1 import events_pb2 as ev


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
        # Ids that tasks here name as dependencies, with how many name each (built on first use).
        self._dependency_targets: Counter[str] | None = None
        self.model_names: list[str] = []
        self._model_index: dict[str, int] = {}
        self.feasibility = FeasibilityFilter()  # the hard constraints, and its index of devices by group
        self._tasks_on_device: dict[int, set[str]] = {}
        # Partitions (docs/fractional.md): a partition's id -> (its parent's id, its profile), and a
        # parent's id -> its partitions' ids (a parent may come after its partitions); the live
        # devices that are shareable or partitions.
        self.partitions: dict[str, tuple[str, str]] = {}
        self._partitions_of: dict[str, set[str]] = {}
        self.shared_devices = 0
        self.newest_telemetry_ms = 0
        self.version = 0
        self.metrics_version = 0
        self.changes = 0
        self._arrivals = 0
        self._speed_marks: tuple[int, tuple[object, ...]] = (-1, ())  # (version, speed_marks())

    def speed_marks(self) -> tuple[object, ...]:
        """What a task's estimated run time per device group reads of the inventory: the model
        names known, and each (kind, model) group's representative row (the lowest) with its peak
        TFLOPS (the speed of a model the profiles do not list). Equal marks, equal estimates: an
        inventory change that moves none of them (a device's memory or host, a link, a device
        added to a group above its lowest row) leaves the queue's ranks as they are. Kept per
        inventory version."""
        if self._speed_marks[0] != self.version:
            peak = self.devices.peak_tflops
            groups = sorted((group, row, float(peak[row])) for group, row in self.feasibility.representatives().items())
            self._speed_marks = (self.version, (len(self.model_names), tuple(groups)))
        return self._speed_marks[1]

    @property
    def arrivals(self) -> int:
        """Tasks submitted so far: the last one's ``Task.arrival`` (a later one's is greater)."""
        return self._arrivals

    @property
    def exclusive(self) -> bool:
        """Whether a device holds one task at a time: only then can a task wait for a busy one
        (with shared devices it starts at once on a share instead)."""
        return self.max_tasks_per_device == 1

    def tables_copy(self, task_rows: Rows | None = None) -> InfraGraph:
        """A graph to read while this one changes (the GNN's encoder inputs, built outside the
        daemon's lock): its tables are copies, everything else is shared, ``tasks`` included,
        which it must only look up in (a task's spec never changes, nor its devices once bound).
        ``task_rows``: the task table's copy holds these live rows only, renumbered from 0 (what
        the encoder reads of a long queue), so that a copy does not grow with the queue. Not for
        changing."""
        twin = copy.copy(self)
        twin.devices, twin.hosts, twin.switches = self.devices.copy(), self.hosts.copy(), self.switches.copy()
        tasks = self.task_table
        twin.links, twin.task_table = self.links.copy(), tasks.copy() if task_rows is None else tasks.subset(task_rows)
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

    def model_numbers(self, models: Iterable[str]) -> list[int]:
        """Indices into ``model_names`` of the known ones among ``models``."""
        index = self._model_index
        return [index[m] for m in models if m in index]

    def affected_rows(self, rows: Sequence[int]) -> list[int]:
        """``rows`` and the devices whose room a binding there changes too: a partition's parent,
        a parent's partitions (docs/fractional.md)."""
        if not self.partitions:
            return list(rows)
        d, index = self.devices, self.devices.index
        out = list(rows)
        for row in rows:
            if d.partition[row] and d.parent[row] >= 0:
                out.append(int(d.parent[row]))
            for child in self._partitions_of.get(d.ids[row] or "", ()):
                out.append(index[child])
        return out

    def reindex_sharing(self, partitions: dict[str, tuple[str, str]]) -> None:
        """Rebuild what the device table does not hold of fractional use (a restored snapshot's
        tables): the partitions by id, their parents' partitions, and the count of shared devices."""
        self.partitions = dict(partitions)
        self._partitions_of = {}
        for child, (parent, _) in self.partitions.items():
            self._partitions_of.setdefault(parent, set()).add(child)
        d = self.devices
        self.shared_devices = int(np.count_nonzero(d.alive & ((d.sharing > 0) | d.partition)))

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

    def allocated_by_model(self) -> dict[str, float]:
        """Devices' worth held by tasks, per device model (docs/fractional.md): an exclusive device
        holding a task counts 1, a shareable one the share held over its capacity (at most 1), a
        partition holding a task its compute share; a parent counts through its partitions."""
        d = self.devices
        rows = d.live_rows()
        if not len(rows):
            return {}
        held = d.n_tasks[rows] > 0
        capacity = np.maximum(d.share_capacity[rows], 1).astype(np.float64)
        worth = np.where(held, 1.0, 0.0)
        if self.shared_devices:
            shared, partition = d.sharing[rows] > 0, d.partition[rows]
            worth = np.where(shared, np.minimum(d.share_used[rows] / capacity, 1.0), worth)
            worth = np.where(partition & held, capacity / WHOLE_SHARE, np.where(partition, 0.0, worth))
        totals = np.bincount(d.model[rows], weights=worth, minlength=len(self.model_names))
        present = np.unique(d.model[rows])
        return {self.model_names[int(m)]: float(totals[m]) for m in present if m >= 0}

    # -- hard constraints (the filter's) ---------------------------------------------------

    def feasible_rows(self, spec: ev.TaskSpec) -> Rows:
        """``FeasibilityFilter.feasible_rows`` of this graph. Shapes: -> [F]."""
        return self.feasibility.feasible_rows(self, spec)

    def busy_rows(self, spec: ev.TaskSpec, faster_models: NDArray[np.int64] | None = None) -> Rows:
        """``FeasibilityFilter.busy_rows`` of this graph. Shapes: -> [B]."""
        return self.feasibility.busy_rows(self, spec, faster_models)

    def group_representatives(self, spec: ev.TaskSpec) -> Rows:
        """``FeasibilityFilter.group_representatives`` of this graph. Shapes: -> [G]."""
        return self.feasibility.group_representatives(self, spec)

    def room(self, spec: ev.TaskSpec, rows: Rows, occupancy: Occupancy | None = None) -> NDArray[np.bool_]:
        """``FeasibilityFilter.room`` of this graph. Shapes: [N] -> [N]."""
        return self.feasibility.room(self, spec, rows, occupancy)

    def violations(self, spec: ev.TaskSpec, rows: Rows) -> NDArray[np.int8]:
        """``FeasibilityFilter.violations`` of this graph. Shapes: [N] -> [N]."""
        return self.feasibility.violations(self, spec, rows)

    def exclusion_counts(self, spec: ev.TaskSpec) -> Counter[str]:
        """``FeasibilityFilter.exclusion_counts`` of this graph."""
        return self.feasibility.exclusion_counts(self, spec)

    def exclusions(self, spec: ev.TaskSpec, limit: int) -> list[Exclusion]:
        """``FeasibilityFilter.exclusions`` of this graph."""
        return self.feasibility.exclusions(self, spec, limit)

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
        elif self._apply_inventory(kind, event):
            self.version += 1
            self.changes += 1
        self.saw_telemetry(event.event_time_ms)

    def saw_telemetry(self, event_time_ms: int) -> None:
        """Telemetry of ``event_time_ms`` was applied: ``newest_telemetry_ms`` is at least that."""
        self.newest_telemetry_ms = max(self.newest_telemetry_ms, event_time_ms)

    def forget_times_after(self, limit_ms: int) -> bool:
        """Forget event times later than ``limit_ms`` (a restored snapshot's, from before times were
        checked, or the daemon's clock set back), so that they cannot hold staleness at 0: such a
        device's metrics time becomes 0 (unknown) and ``newest_telemetry_ms`` the newest device
        time left (0: none). Costs a pass over the devices only when ``newest_telemetry_ms``, the
        latest of all, is later. Returns whether anything was forgotten."""
        if self.newest_telemetry_ms <= limit_ms:
            return False
        d = self.devices
        d.metrics_ms[d.metrics_ms > limit_ms] = 0
        live = d.metrics_ms[d.alive]
        self.newest_telemetry_ms = int(live.max()) if live.size else 0
        return True

    def _apply_inventory(self, kind: str, event: ev.TelemetryEvent) -> bool:
        """Apply an inventory event; False when it changed nothing: an upsert of a device, host or
        link exactly as the graph has it (agents send their whole inventory again every few
        minutes), which then leaves the inventory's version, and every cache kept by it, alone.
        Each upsert is validated here, once, whether or not it changes anything."""
        if kind == "device_upsert":
            device = event.device_upsert
            check_device(device)
            row = self.devices.row(device.id)
            self._check_sharing(device, row)
            if self._device_as_known(device, row):
                return False
            self._upsert_device(device, row)
        elif kind == "host_upsert":
            check_host(event.host_upsert)
            if self._host_as_known(event.host_upsert):
                return False
            self._upsert_host(event.host_upsert)
        elif kind == "link_upsert":
            link = event.link_upsert
            check_link(link)
            src = self._endpoint(link.src_id, f"link {link.id} src")
            dst = self._endpoint(link.dst_id, f"link {link.id} dst")
            if self._link_as_known(link, src, dst):
                return False
            self._upsert_link(link, src, dst)
        elif kind == "device_removed":
            self._remove_device(event.device_removed.id)
        elif kind == "host_removed":
            self._remove_host(event.host_removed.id)
        elif kind == "switch_upsert":
            self._upsert_switch(event.switch_upsert)
        elif kind == "switch_removed":
            self._remove_switch(event.switch_removed.id)
        elif kind == "link_removed":
            self.links.remove(event.link_removed.id)
        return True

    def _device_as_known(self, spec: ev.Device, row: int | None) -> bool:
        """Whether upserting ``spec`` (its device's ``row``, None for a new one) would change
        nothing: every field the graph keeps of it (:meth:`_upsert_device`, :meth:`_set_sharing`)
        already has its value."""
        d = self.devices
        if row is None:
            return False
        host, model = int(d.host[row]), self._model_index.get(spec.model)
        parent = d.row(spec.parent_id) if spec.parent_id else None
        partition = self.partitions.get(spec.id)
        return (
            host >= 0
            and self.hosts.ids[host] == spec.host_id
            and model is not None
            and int(d.model[row]) == model
            and int(d.kind[row]) == int(spec.kind)
            and (d.memory_gb[row], d.peak_tflops[row], d.idle_power_w[row], d.peak_power_w[row])
            == (spec.memory_gb, spec.peak_tflops, spec.idle_power_w, spec.peak_power_w)
            and int(d.sharing[row]) == int(spec.sharing)
            and bool(d.partition[row]) == bool(spec.parent_id)
            and int(d.share_capacity[row])
            == (spec.compute_share_milli if spec.parent_id else spec.share_capacity_milli or WHOLE_SHARE)
            and int(d.parent[row]) == (-1 if parent is None else parent)
            and partition == ((spec.parent_id, spec.partition_profile) if spec.parent_id else None)
        )

    def _host_as_known(self, spec: ev.Host) -> bool:
        """Whether upserting ``spec`` would change nothing (:meth:`_upsert_host`)."""
        h = self.hosts
        row = h.row(spec.id)
        if row is None or h.placeholder[row]:
            return False
        rack = self.switches.row(spec.rack_id) if spec.rack_id else -1
        return (
            rack is not None
            and int(h.rack[row]) == rack
            and (h.cpu_cores[row], h.memory_gb[row]) == (spec.cpu_cores, spec.memory_gb)
        )

    def _link_as_known(self, link: ev.Link, src: tuple[int, int], dst: tuple[int, int]) -> bool:
        """Whether upserting ``link`` between ``src`` and ``dst`` (node type and row of each end)
        would change nothing (:meth:`_upsert_link`)."""
        t = self.links
        row = t.row(link.id)
        if row is None:
            return False
        return (
            (int(t.src_type[row]), int(t.src[row]), int(t.dst_type[row]), int(t.dst[row])) == (*src, *dst)
            and int(t.kind[row]) == int(link.kind)
            and (t.bandwidth_gbps[row], t.latency_us[row]) == (link.bandwidth_gbps, link.latency_us)
        )

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

    def _upsert_device(self, spec: ev.Device, row: int | None) -> None:
        """Apply ``spec`` to its device's ``row`` (None: a new device); validated by the caller
        (``check_device``, :meth:`_check_sharing`)."""
        d = self.devices
        model = self._intern_model(spec.model)
        if row is None:
            row, regroup = d.add(spec.id), True
        else:  # an update keeps what was measured and reserved; it may move group or host
            # The same kind and model (an agent sending its inventory again): the feasibility
            # index keeps the row, and its cached rows of the group.
            regroup = (int(d.kind[row]), int(d.model[row])) != (int(spec.kind), model)
            if regroup:
                self._leave_group(row)
            if self.hosts.ids[d.host[row]] != spec.host_id:
                self._leave_host(row)
        if d.host[row] < 0 or self.hosts.ids[d.host[row]] != spec.host_id:
            host = self._host_row(spec.host_id)
            self.hosts.n_devices[host] += 1
            d.host[row] = host
        d.kind[row] = spec.kind
        d.model[row] = model
        d.memory_gb[row] = spec.memory_gb
        d.peak_tflops[row] = spec.peak_tflops
        d.idle_power_w[row] = spec.idle_power_w
        d.peak_power_w[row] = spec.peak_power_w
        self._set_sharing(spec, row)
        if regroup:
            self.feasibility.join(row, int(spec.kind), model)

    def _check_sharing(self, spec: ev.Device, row: int | None) -> None:
        """What the graph must know to accept a device's sharing (docs/fractional.md): a partition's
        parent (when known) is on its host and neither a partition nor shareable; a device with
        partitions is not shareable nor a partition; a device that holds tasks keeps its sharing."""
        d = self.devices
        name = f"device {spec.id}"
        if spec.parent_id:
            parent = d.row(spec.parent_id)
            if parent is not None:
                if d.partition[parent]:
                    raise InvalidEventError(f"{name}: parent {spec.parent_id} is a partition itself", "inconsistent")
                if d.sharing[parent]:
                    raise InvalidEventError(f"{name}: parent {spec.parent_id} is shareable", "inconsistent")
                if self.hosts.ids[d.host[parent]] != spec.host_id:
                    raise InvalidEventError(
                        f"{name}: on host {spec.host_id}, its parent {spec.parent_id} on another", "inconsistent"
                    )
        if (spec.sharing or spec.parent_id) and self._partitions_of.get(spec.id):
            what = "shareable" if spec.sharing else "a partition"
            raise InvalidEventError(f"{name} has partitions: it cannot be {what}", "inconsistent")
        if row is None:
            return
        capacity = spec.compute_share_milli if spec.parent_id else spec.share_capacity_milli or WHOLE_SHARE
        was = (int(d.sharing[row]), bool(d.partition[row]), int(d.share_capacity[row]))
        parent_was = self.partitions.get(spec.id, ("", ""))[0]
        changed = was != (spec.sharing, bool(spec.parent_id), capacity) or parent_was != spec.parent_id
        if changed and (d.n_tasks[row] or d.busy_partitions[row]):
            raise InvalidEventError(f"{name}: its sharing cannot change while it holds tasks", "in_use")

    def _set_sharing(self, spec: ev.Device, row: int) -> None:
        """Set the device's sharing columns and the partition index (checked by ``_check_sharing``)."""
        d = self.devices
        self.shared_devices -= int(bool(d.sharing[row]) or bool(d.partition[row]))
        self._forget_partition(spec.id)
        d.sharing[row] = spec.sharing
        d.partition[row] = bool(spec.parent_id)
        d.parent[row] = -1
        if spec.parent_id:
            d.share_capacity[row] = spec.compute_share_milli
            self.partitions[spec.id] = (spec.parent_id, spec.partition_profile)
            self._partitions_of.setdefault(spec.parent_id, set()).add(spec.id)
            parent = d.row(spec.parent_id)
            if parent is not None:
                d.parent[row] = parent
        else:
            d.share_capacity[row] = spec.share_capacity_milli or WHOLE_SHARE
        self.shared_devices += int(bool(spec.sharing) or bool(spec.parent_id))
        children = self._partitions_of.get(spec.id)
        if children:  # a parent that came after its partitions, or came back
            rows = [d.index[c] for c in children]
            d.parent[rows] = row
            d.busy_partitions[row] = int(np.count_nonzero(d.n_tasks[rows]))

    def _forget_partition(self, device_id: str) -> None:
        """``device_id`` is no partition in the index any more (it changes or goes)."""
        known = self.partitions.pop(device_id, None)
        if known is not None:
            siblings = self._partitions_of[known[0]]
            siblings.discard(device_id)
            if not siblings:
                del self._partitions_of[known[0]]

    def _leave_group(self, row: int) -> None:
        self.feasibility.leave(row, int(self.devices.kind[row]), int(self.devices.model[row]))

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
        d = self.devices
        device_id = d.ids[row] or ""
        self.shared_devices -= int(bool(d.sharing[row]) or bool(d.partition[row]))
        self._forget_partition(device_id)
        for child in self._partitions_of.get(device_id, ()):  # they wait for their parent to come back
            d.parent[d.index[child]] = -1
        self._drop_links(DEVICE_NODE, np.array([row]))
        self._leave_group(row)
        self._leave_host(row)
        self.devices.remove(self.devices.ids[row] or "")

    def _upsert_host(self, spec: ev.Host) -> None:
        """Apply ``spec``; validated by the caller (``check_host``)."""
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
        check_id(spec.id, "switch")
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

    def _upsert_link(self, link: ev.Link, src_end: tuple[int, int], dst_end: tuple[int, int]) -> None:
        """Apply ``link`` between its ends (node type and row of each); validated by the caller
        (``check_link``, :meth:`_endpoint`)."""
        (src_type, src), (dst_type, dst) = src_end, dst_end
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
        event_time_ms: int | NDArray[np.int64] = 0,
    ) -> None:
        """Validate then apply one report per row. Shapes: every array [N]; ``ids`` names rows in errors.

        A health of HEALTH_UNSPECIFIED keeps the device's current health. When a row appears
        twice, the later report wins. ``event_time_ms``: the reports' event time, one for all or
        one per report ([N], as a poll of many records brings); 0 leaves a row's time as it was.
        """
        d = self.devices
        check_device_metrics(utilization, memory_used_gb, power_w, temperature_c, health, ids, d.memory_gb[rows])
        d.utilization[rows] = utilization
        d.memory_used_gb[rows] = memory_used_gb
        d.power_w[rows] = power_w
        d.temperature_c[rows] = temperature_c
        known = health != ev.HEALTH_UNSPECIFIED
        d.health[rows[known]] = health[known]
        if isinstance(event_time_ms, np.ndarray):
            timed = event_time_ms > 0
            d.metrics_ms[rows[timed]] = event_time_ms[timed]
        elif event_time_ms:
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
            check_range(m.utilization, f"link {m.link_id} utilization", 0.0, 1.0)
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
        if not plain and self.dependency_cycle(spec):
            raise InvalidEventError(f"task {spec.id}: its dependencies lead back to it", "cycle")
        self._arrivals += 1
        task = Task(spec=spec, cell=cell, arrival=self._arrivals, plain=plain)
        task.row = self.task_table.add(task_id)
        self.task_table.describe(task.row, spec, task.arrival, plain)
        self.tasks[task_id] = task
        if not plain and self._dependency_targets is not None:
            self._dependency_targets.update(d.task_id for d in spec.dependencies)
        return task

    def dependency_cycle(self, spec: ev.TaskSpec) -> list[str]:
        """The cycle ``spec`` would close through the known tasks, or [] (:func:`dependency_cycle`);
        a new task that no known task names as a dependency costs no walk up its chain."""
        if self._dependency_targets is None:  # first use, or a graph restored from a snapshot
            self._dependency_targets = Counter(d.task_id for t in self.tasks.values() for d in t.spec.dependencies)
        return dependency_cycle(spec, self.tasks, self._dependency_targets)

    def drop_task(self, task_id: str) -> Task:
        """Forget a task (an ended one, or one whose submission is withdrawn): out of ``tasks``, its
        task table row and the dependency index."""
        task = self.tasks.pop(task_id)
        if task.row >= 0:
            self.task_table.remove(task_id)
            task.row = -1
        targets = self._dependency_targets
        if targets is not None:
            for dep in task.spec.dependencies:
                targets[dep.task_id] -= 1
                if targets[dep.task_id] <= 0:
                    del targets[dep.task_id]
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

    def bind(self, task: Task, rows: Sequence[int], device_ids: Sequence[str] | None = None) -> None:
        """Reserve the task's memory on each of its devices (rows of live devices; ``device_ids``:
        their ids, when the caller has them already)."""
        d = self.devices
        memory, task_id = task.spec.memory_per_device_gb, task.spec.id
        on_device = self._tasks_on_device
        task.device_rows = held = tuple(map(int, rows))
        shared = self.shared_devices
        for row in held:
            d.reserved_gb[row] += memory
            d.placed_gb[row] += memory
            d.n_tasks[row] += 1
            on_device.setdefault(row, set()).add(task_id)
        if shared:
            self._hold_shares(task, held, 1)
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
                if self.shared_devices:
                    self._hold_shares(task, (row,), -1)
                if ran:
                    d.memory_used_gb[row] = max(0.0, d.memory_used_gb[row] - memory)
                    if d.n_tasks[row] == 0:
                        d.utilization[row] = 0.0
        self._set_state(task, final_state)
        self.changes += len(task.device_rows)

    def _hold_shares(self, task: Task, rows: Sequence[int], sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) the share the task holds on ``rows`` (bound or
        released there: ``n_tasks`` already counts the change), and a partition's on its parent."""
        d = self.devices
        rows_array = np.fromiter(rows, dtype=np.int64, count=len(rows))
        charge = share_charge(d, task.spec.device_share_milli, rows_array)
        for row, held in zip(rows, charge.tolist(), strict=True):
            d.share_used[row] = max(0, int(d.share_used[row]) + sign * held)
            parent = int(d.parent[row])
            if d.partition[row] and parent >= 0 and d.n_tasks[row] == (1 if sign > 0 else 0):
                d.busy_partitions[parent] = max(0, int(d.busy_partitions[parent]) + sign)

    def unbind(self, task: Task) -> None:
        """Take back a placed task's devices (its placement was withdrawn): pending again, unbound."""
        self.release(task, TaskState.PENDING)
        task.device_rows, task.device_ids = (), ()
        if task.row >= 0:
            self.task_table.hold(task.row, ())

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
