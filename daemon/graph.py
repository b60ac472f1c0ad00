"""The daemon's picture of the infrastructure: devices, hosts, switches, links and tasks.

This is the walking skeleton's graph: plain records keyed by id, enough for feasibility checks
and a least-loaded policy. Pure: no I/O, no clock; callers pass event times in.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from daemon.errors import InvalidEventError
from hlb.v1 import events_pb2 as ev

MAX_GANG = 4096
MAX_MEMORY_GB = 1.0e6
MAX_ID_CHARS = 256


class TaskState(enum.Enum):
    PENDING = "pending"
    PLACED = "placed"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def holds_devices(self) -> bool:
        return self in (TaskState.PLACED, TaskState.RUNNING)

    @property
    def is_final(self) -> bool:
        return self in (TaskState.FINISHED, TaskState.FAILED, TaskState.CANCELLED)


@dataclass
class Device:
    """One accelerator, with what telemetry says of it and what hlb has reserved on it."""

    id: str
    host_id: str
    cell: str
    kind: int  # ev.DeviceKind
    model: str
    memory_gb: float
    peak_tflops: float
    idle_power_w: float
    peak_power_w: float
    utilization: float = 0.0
    memory_used_gb: float = 0.0
    power_w: float = 0.0
    health: int = ev.HEALTH_HEALTHY
    reserved_gb: float = 0.0
    task_ids: set[str] = field(default_factory=set)

    @property
    def free_memory_gb(self) -> float:
        # Reported use may already include hlb's own tasks, so the larger of the two counts.
        return self.memory_gb - max(self.reserved_gb, self.memory_used_gb)

    @property
    def load(self) -> float:
        """0 (idle) .. 1 (busy): the larger of measured utilization and reserved memory share."""
        share = self.reserved_gb / self.memory_gb if self.memory_gb > 0 else 1.0
        return max(self.utilization, min(share, 1.0))


@dataclass
class Task:
    spec: ev.TaskSpec
    cell: str
    arrival: int  # order of arrival, for FIFO within a priority
    state: TaskState = TaskState.PENDING
    device_ids: tuple[str, ...] = ()
    pending_reason: str = "not yet considered"

    @property
    def gang_size(self) -> int:
        return max(1, self.spec.num_devices)


def _check_id(value: str, what: str) -> None:
    if not value:
        raise InvalidEventError(f"{what}: empty id", "missing_id")
    if len(value) > MAX_ID_CHARS:
        raise InvalidEventError(f"{what}: id longer than {MAX_ID_CHARS} characters", "invalid_id")


def _check_range(value: float, what: str, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidEventError(f"{what}={value!r} is outside [{low}, {high}]", "out_of_range")


@dataclass
class InfraGraph:
    """Devices, hosts, switches, links and tasks of one daemon, keyed by id."""

    devices: dict[str, Device] = field(default_factory=dict)
    hosts: dict[str, ev.Host] = field(default_factory=dict)
    switches: dict[str, ev.Switch] = field(default_factory=dict)
    links: dict[str, ev.Link] = field(default_factory=dict)
    tasks: dict[str, Task] = field(default_factory=dict)
    newest_telemetry_ms: int = 0
    _arrivals: int = 0

    # -- inventory -------------------------------------------------------------------------

    def apply_telemetry(self, event: ev.TelemetryEvent) -> None:
        """Apply one telemetry event; raise ``InvalidEventError`` (changing nothing) if it is bad."""
        kind = event.WhichOneof("payload")
        if kind is None:
            raise InvalidEventError("telemetry event without a payload", "empty")
        if kind == "device_upsert":
            self._upsert_device(event.device_upsert, event.cell)
        elif kind == "device_removed":
            self._remove_device(event.device_removed.id)
        elif kind == "host_upsert":
            _check_id(event.host_upsert.id, "host")
            self.hosts[event.host_upsert.id] = event.host_upsert
        elif kind == "host_removed":
            self._remove_host(event.host_removed.id)
        elif kind == "switch_upsert":
            _check_id(event.switch_upsert.id, "switch")
            self.switches[event.switch_upsert.id] = event.switch_upsert
        elif kind == "switch_removed":
            self.switches.pop(event.switch_removed.id, None)
        elif kind == "link_upsert":
            self._upsert_link(event.link_upsert)
        elif kind == "link_removed":
            self.links.pop(event.link_removed.id, None)
        elif kind == "device_metrics":
            self._check_metrics(event.device_metrics)
            self._apply_metrics(event.device_metrics)
        elif kind == "metrics_batch":
            for metrics in event.metrics_batch.devices:  # validate all before applying any
                self._check_metrics(metrics)
            for metrics in event.metrics_batch.devices:
                self._apply_metrics(metrics)
        # link_metrics: accepted; the skeleton's policy does not use link load yet.
        self.newest_telemetry_ms = max(self.newest_telemetry_ms, event.event_time_ms)

    def _upsert_device(self, spec: ev.Device, cell: str) -> None:
        _check_id(spec.id, "device")
        _check_id(spec.host_id, f"device {spec.id} host")
        _check_range(spec.memory_gb, f"device {spec.id} memory_gb", 0.0, MAX_MEMORY_GB)
        _check_range(spec.peak_tflops, f"device {spec.id} peak_tflops", 0.0, 1.0e7)
        _check_range(spec.idle_power_w, f"device {spec.id} idle_power_w", 0.0, 1.0e5)
        _check_range(spec.peak_power_w, f"device {spec.id} peak_power_w", 0.0, 1.0e5)
        if spec.kind not in ev.DeviceKind.values() or spec.kind == ev.DEVICE_KIND_UNSPECIFIED:
            raise InvalidEventError(f"device {spec.id}: unknown kind {spec.kind}", "out_of_range")
        old = self.devices.get(spec.id)
        device = Device(
            id=spec.id,
            host_id=spec.host_id,
            cell=cell,
            kind=spec.kind,
            model=spec.model,
            memory_gb=spec.memory_gb,
            peak_tflops=spec.peak_tflops,
            idle_power_w=spec.idle_power_w,
            peak_power_w=spec.peak_power_w,
        )
        if old is not None:  # an update keeps what was measured and reserved
            device.utilization, device.memory_used_gb = old.utilization, old.memory_used_gb
            device.power_w, device.health = old.power_w, old.health
            device.reserved_gb, device.task_ids = old.reserved_gb, old.task_ids
        self.devices[spec.id] = device

    def _remove_device(self, device_id: str) -> None:
        device = self.devices.get(device_id)
        if device is None:
            return  # removing twice is harmless (replays)
        if device.task_ids:
            raise InvalidEventError(f"device {device_id} still runs tasks {sorted(device.task_ids)}", "in_use")
        del self.devices[device_id]

    def _remove_host(self, host_id: str) -> None:
        busy = [d.id for d in self.devices.values() if d.host_id == host_id and d.task_ids]
        if busy:
            raise InvalidEventError(f"host {host_id} has busy devices {busy}", "in_use")
        for device_id in [d.id for d in self.devices.values() if d.host_id == host_id]:
            del self.devices[device_id]
        self.hosts.pop(host_id, None)

    def _upsert_link(self, link: ev.Link) -> None:
        _check_id(link.id, "link")
        _check_id(link.src_id, f"link {link.id} src")
        _check_id(link.dst_id, f"link {link.id} dst")
        _check_range(link.bandwidth_gbps, f"link {link.id} bandwidth_gbps", 0.0, 1.0e6)
        _check_range(link.latency_us, f"link {link.id} latency_us", 0.0, 1.0e9)
        self.links[link.id] = link

    def _check_metrics(self, metrics: ev.DeviceMetrics) -> None:
        device = self.devices.get(metrics.device_id)
        if device is None:
            raise InvalidEventError(f"metrics for unknown device {metrics.device_id!r}", "unknown_id")
        _check_range(metrics.utilization, f"device {device.id} utilization", 0.0, 1.0)
        _check_range(metrics.memory_used_gb, f"device {device.id} memory_used_gb", 0.0, device.memory_gb)
        _check_range(metrics.power_w, f"device {device.id} power_w", 0.0, 1.0e5)
        _check_range(metrics.temperature_c, f"device {device.id} temperature_c", -100.0, 400.0)
        if metrics.health not in ev.Health.values():
            raise InvalidEventError(f"device {device.id}: unknown health {metrics.health}", "out_of_range")

    def _apply_metrics(self, metrics: ev.DeviceMetrics) -> None:
        device = self.devices[metrics.device_id]
        device.utilization = metrics.utilization
        device.memory_used_gb = metrics.memory_used_gb
        device.power_w = metrics.power_w
        if metrics.health != ev.HEALTH_UNSPECIFIED:
            device.health = metrics.health

    # -- tasks -----------------------------------------------------------------------------

    def add_task(self, spec: ev.TaskSpec, cell: str) -> Task:
        """Record a submitted task (validated); a replay of the same submission returns it unchanged."""
        check_task_spec(spec)
        known = self.tasks.get(spec.id)
        if known is not None:
            if known.spec != spec:
                raise InvalidEventError(f"task {spec.id} was already submitted with another spec", "duplicate_id")
            return known
        self._arrivals += 1
        task = Task(spec=spec, cell=cell, arrival=self._arrivals)
        self.tasks[spec.id] = task
        return task

    def bind(self, task: Task, device_ids: tuple[str, ...]) -> None:
        """Reserve the task's memory on each of its devices."""
        for device_id in device_ids:
            device = self.devices[device_id]
            device.reserved_gb += task.spec.memory_per_device_gb
            device.task_ids.add(task.spec.id)
        task.device_ids = device_ids
        task.state = TaskState.PLACED

    def release(self, task: Task, final_state: TaskState) -> None:
        """Return the task's reservations and move it to a final state."""
        for device_id in task.device_ids:
            device = self.devices.get(device_id)
            if device is not None and task.spec.id in device.task_ids:
                device.task_ids.discard(task.spec.id)
                device.reserved_gb = max(0.0, device.reserved_gb - task.spec.memory_per_device_gb)
        task.state = final_state


def check_task_spec(spec: ev.TaskSpec) -> None:
    """Raise ``InvalidEventError`` naming the field when a task spec is out of range."""
    _check_id(spec.id, "task")
    if spec.num_devices > MAX_GANG:
        raise InvalidEventError(f"task {spec.id}: num_devices={spec.num_devices} exceeds {MAX_GANG}", "out_of_range")
    _check_range(spec.memory_per_device_gb, f"task {spec.id} memory_per_device_gb", 0.0, MAX_MEMORY_GB)
    _check_range(spec.work_ref_s, f"task {spec.id} work_ref_s", 0.0, 1.0e10)
    _check_range(spec.latency_slo_ms, f"task {spec.id} latency_slo_ms", 0.0, 1.0e9)
    for kind in spec.allowed_kinds:
        if kind not in ev.DeviceKind.values() or kind == ev.DEVICE_KIND_UNSPECIFIED:
            raise InvalidEventError(f"task {spec.id}: unknown allowed kind {kind}", "out_of_range")
    for dep in spec.dependencies:
        if dep.task_id == spec.id:
            raise InvalidEventError(f"task {spec.id} depends on itself", "cycle")
        _check_id(dep.task_id, f"task {spec.id} dependency")
        _check_range(dep.transfer_gb, f"task {spec.id} dependency transfer_gb", 0.0, MAX_MEMORY_GB)
