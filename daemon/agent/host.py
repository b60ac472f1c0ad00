"""The host agent: reads its sources every interval and publishes what they read as hlb's telemetry.

Each round (``HostAgent.step``):

- inventory, when a device or the host is new or changed, and all of it again every
  ``inventory_interval_s`` (a daemon that lost it learns it back): the host, then each device
  (``hlb.daemon.agent.models``: a catalogue model, or its nameplate), then the links between them;
- one ``metrics_batch`` of every device's metrics;
- one ``HostTasks`` listing the hlb tasks running here (from the sources: NVML's process
  environments, DCGM's ``hpc_job`` label; and from the executor's task files in ``tasks_dir``),
  which keeps their leases (hlb.daemon.decide.leases).

Devices several sources report (NVML and DCGM both see a GPU by its UUID) are taken from the
first source listed. A source that cannot be read is logged (once until it works again) and
skipped for that round; the others publish as usual.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from hlb.daemon.agent.models import ModelCatalogue
from hlb.daemon.agent.readings import DeviceReading, HostReading, LinkReading, RunningTask, Source, SourceError
from hlb.daemon.bus.seam import Publisher
from hlb.daemon.config import Topics
from hlb.daemon.runtime.sdnotify import SystemdNotifier, WatchdogPinger
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

SOURCE = "hlb-agent"


@dataclass(frozen=True)
class TaskFile:
    """What an executor writes to ``tasks_dir`` per task it runs here, as ``<anything>.json``:
    ``{"task_id": "...", "placement_sequence": 7, "device_ids": ["GPU-..."]}``; removed when the
    task ends."""

    task: RunningTask
    device_ids: tuple[str, ...]


def read_task_files(folder: Path) -> list[TaskFile]:
    """The task files in ``folder``; one that does not parse is logged and skipped."""
    found: list[TaskFile] = []
    for path in sorted(folder.glob("*.json")):
        try:
            document = json.loads(path.read_text())
            task_id = str(document["task_id"])
            sequence = int(document.get("placement_sequence", 0))
            devices = tuple(str(d) for d in document.get("device_ids", ()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("task file skipped", path=str(path), error=str(exc))
            continue
        if task_id and sequence >= 0:
            found.append(TaskFile(RunningTask(task_id, sequence), devices))
    return found


class HostAgent:
    def __init__(
        self,
        sources: Sequence[Source],
        publisher: Publisher,
        topics: Topics,
        cell: str,
        catalogue: ModelCatalogue,
        *,
        host_id: str = "",
        rack_id: str = "",
        tasks_dir: Path | None = None,
        report_tasks: bool = True,
        inventory_interval_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sources = list(sources)
        self.publisher = publisher
        self.topics = topics
        self.cell = cell
        self.catalogue = catalogue
        self.host_id = host_id
        self.rack_id = rack_id
        self.tasks_dir = tasks_dir
        self.report_tasks = report_tasks
        self.inventory_interval_s = inventory_interval_s
        self.clock = clock
        self._published: dict[str, bytes] = {}  # entity id -> the inventory value last published
        self._next_inventory = 0.0
        self._failing: set[str] = set()
        self._warned_nameplate: set[str] = set()

    def step(self) -> int:
        """Read every source and publish; returns how many devices were reported."""
        now = self.clock()
        host, devices, links = self._read()
        if host is None:
            if not self.host_id:
                log.warning("no host id: set agent.host_id, or add the node source")
                return 0
            host = HostReading(self.host_id)
        if self.host_id:
            host.id = self.host_id
        full = now >= self._next_inventory
        if full:
            self._next_inventory = now + self.inventory_interval_s
        self._inventory(ev.TelemetryEvent(host_upsert=ev.Host(id=host.id, rack_id=self.rack_id,
                        cpu_cores=host.cpu_cores, memory_gb=host.memory_gb)), host.id, full)  # fmt: skip
        for device in devices:
            spec = self.catalogue.describe(device, host.id)
            self._warn_unknown_speed(spec)
            self._inventory(ev.TelemetryEvent(device_upsert=spec), device.id, full)
        known = {d.id for d in devices}
        for link in links:  # after the devices and the host they join
            if link.src_id in known and (not link.dst_id or link.dst_id in known):
                upsert = ev.Link(id=link.id, src_id=link.src_id, dst_id=link.dst_id or host.id, kind=link.kind,
                                 bandwidth_gbps=link.bandwidth_gbps, latency_us=link.latency_us)  # fmt: skip
                self._inventory(ev.TelemetryEvent(link_upsert=upsert), link.id, full)
        if devices:
            batch = ev.MetricsBatch(devices=[_metrics(d) for d in devices])
            self._publish(ev.TelemetryEvent(metrics_batch=batch), now)
        if self.report_tasks:
            self._publish(ev.TelemetryEvent(host_tasks=self._host_tasks(host.id, devices)), now)
        self.publisher.flush(10.0)
        return len(devices)

    def run(
        self,
        stop: threading.Event,
        interval_s: float,
        notifier: SystemdNotifier | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """Step every ``interval_s`` until ``stop`` is set. Under systemd (``notifier``): READY=1
        after the first round, WATCHDOG=1 from this loop, STOPPING=1 at the end."""
        notifier = notifier if notifier is not None else SystemdNotifier({})
        pinger = WatchdogPinger(notifier)
        ready = False
        while not stop.is_set():
            started = monotonic()
            devices = self.step()
            if not ready:
                notifier.ready(f"publishing {devices} devices every {interval_s:g} s")
                ready = True
            pinger.tick(monotonic())
            stop.wait(max(0.0, interval_s - (monotonic() - started)))
        notifier.stopping()
        self.publisher.flush(10.0)

    def _read(self) -> tuple[HostReading | None, list[DeviceReading], list[LinkReading]]:
        host: HostReading | None = None
        devices: dict[str, DeviceReading] = {}
        links: dict[str, LinkReading] = {}
        for source in self.sources:
            try:
                reading = source.read()
            except SourceError as exc:
                if source.name not in self._failing:
                    log.error("source not read; tried again each interval", source=source.name, error=str(exc))
                    self._failing.add(source.name)
                continue
            if source.name in self._failing:
                log.info("source read again", source=source.name)
                self._failing.discard(source.name)
            if host is None:
                host = reading.host
            for device in reading.devices:
                devices.setdefault(device.id, device)
            for link in reading.links:
                links.setdefault(link.id, link)
        return host, list(devices.values()), list(links.values())

    def _host_tasks(self, host_id: str, devices: list[DeviceReading]) -> ev.HostTasks:
        on: dict[tuple[str, int], list[str]] = {}
        for device in devices:
            for task in device.tasks:
                on.setdefault((task.task_id, task.placement_sequence), []).append(device.id)
        if self.tasks_dir is not None and self.tasks_dir.is_dir():
            for entry in read_task_files(self.tasks_dir):
                key = (entry.task.task_id, entry.task.placement_sequence)
                on.setdefault(key, []).extend(d for d in entry.device_ids if d not in on.get(key, []))
        running = [
            ev.RunningTask(task_id=task_id, placement_sequence=sequence, device_ids=ids)
            for (task_id, sequence), ids in sorted(on.items())
        ]
        return ev.HostTasks(host_id=host_id, tasks=running)

    def _inventory(self, event: ev.TelemetryEvent, entity_id: str, full: bool) -> None:
        value = event.SerializeToString(deterministic=True)
        if full or self._published.get(entity_id) != value:
            self._published[entity_id] = value
            self._publish(event, self.clock())

    def _publish(self, event: ev.TelemetryEvent, now: float) -> None:
        event.cell, event.event_time_ms, event.source = self.cell, int(now * 1000), SOURCE
        self.publisher.publish(self.topics.telemetry, self.cell.encode(), event.SerializeToString())

    def _warn_unknown_speed(self, spec: ev.Device) -> None:
        if spec.peak_tflops == 0 and spec.kind != ev.DEVICE_KIND_CPU and spec.model not in self._warned_nameplate:
            self._warned_nameplate.add(spec.model)
            log.warning(
                "device model not in the catalogue and no nameplate given: its speed is unknown to the policies",
                model=spec.model,
                hint="agent.nameplates: {<model>: <peak TFLOPS>}",
            )


def _metrics(device: DeviceReading) -> ev.DeviceMetrics:
    """A device's metrics; a value a source could not read as a number (NaN) is reported as 0."""
    return ev.DeviceMetrics(
        device_id=device.id,
        utilization=_finite(device.utilization),
        memory_used_gb=min(_finite(device.memory_used_gb), _finite(device.memory_gb)),
        power_w=_finite(device.power_w),
        temperature_c=_finite(device.temperature_c),
        health=device.health,
    )


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
