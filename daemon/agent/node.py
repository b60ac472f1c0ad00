"""node_exporter's ``/metrics`` as a source: the host (name, CPU cores, memory) and its CPUs as one
device of kind CPU, with their utilization, memory in use, power and temperature.

Read from node_exporter's default collectors, units converted:

- ``node_uname_info{nodename}``: the host's name;
- ``node_cpu_seconds_total{cpu, mode}`` (s, counters): the cores, and utilization as the share of
  non-idle time between two reads (before a second read: ``node_load1`` over the cores);
- ``node_memory_MemTotal_bytes``, ``node_memory_MemAvailable_bytes`` (bytes -> GiB);
- ``node_rapl_package_joules_total`` (J, counters): power in W between two reads, where RAPL is
  readable;
- ``node_hwmon_temp_celsius`` (°C): the hottest sensor, where there is one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hlb.daemon.agent.prometheus import Fetch, Samples, parse
from hlb.daemon.agent.readings import BYTES_PER_GIB, DeviceReading, HostReading, Reading, SourceError
from hlb.v1 import events_pb2 as ev

IDLE_MODES = frozenset({"idle", "iowait"})


@dataclass(frozen=True)
class _Counters:
    at_s: float
    busy_s: float
    total_s: float
    energy_j: float | None


class NodeSource:
    """Reads node_exporter's text through ``fetch``; ``host_id`` overrides the name it reports."""

    name = "node"

    def __init__(self, fetch: Fetch, monotonic: Callable[[], float], host_id: str = "") -> None:
        self.fetch = fetch
        self.monotonic = monotonic
        self.host_id = host_id
        self._last: _Counters | None = None

    def read(self) -> Reading:
        samples = parse(self.fetch(), "node_exporter")
        cpus = {s.labels.get("cpu", "") for s in samples.get("node_cpu_seconds_total", ())}
        total_bytes = _one(samples, "node_memory_MemTotal_bytes")
        if not cpus or total_bytes is None:
            raise SourceError("node_exporter: no node_cpu_seconds_total or node_memory_MemTotal_bytes in the reply")
        host_id = self.host_id or next(
            (s.labels["nodename"] for s in samples.get("node_uname_info", ()) if s.labels.get("nodename")), ""
        )
        if not host_id:
            raise SourceError("node_exporter: no node_uname_info{nodename}, and no agent.host_id configured")
        memory_gb = total_bytes / BYTES_PER_GIB
        available = _one(samples, "node_memory_MemAvailable_bytes")
        used_gb = max(0.0, total_bytes - available) / BYTES_PER_GIB if available is not None else 0.0
        now = _Counters(self.monotonic(), *_cpu_times(samples), _sum(samples, "node_rapl_package_joules_total"))
        utilization, power_w = self._rates(now, samples, len(cpus))
        self._last = now
        temperatures = [s.value for s in samples.get("node_hwmon_temp_celsius", ()) if math.isfinite(s.value)]
        model = next(
            (s.labels["model_name"] for s in samples.get("node_cpu_info", ()) if s.labels.get("model_name")), "cpu"
        )
        cpu = DeviceReading(
            id=f"{host_id}/cpu",
            kind=ev.DEVICE_KIND_CPU,
            vendor_model=model,
            memory_gb=memory_gb,
            memory_used_gb=min(used_gb, memory_gb),
            utilization=utilization,
            power_w=power_w,
            temperature_c=max(temperatures) if temperatures else 0.0,
            labels={"cores": str(len(cpus))},
        )
        return Reading(HostReading(host_id, float(len(cpus)), memory_gb), [cpu])

    def _rates(self, now: _Counters, samples: Samples, cores: int) -> tuple[float, float]:
        """Utilization (a fraction) and power (W) since the last read; before one, from the load."""
        last = self._last
        if last is None or now.at_s <= last.at_s or now.total_s <= last.total_s:
            load = _one(samples, "node_load1") or 0.0
            return min(1.0, max(0.0, load / max(1, cores))), 0.0
        utilization = min(1.0, max(0.0, (now.busy_s - last.busy_s) / (now.total_s - last.total_s)))
        power = 0.0
        if now.energy_j is not None and last.energy_j is not None and now.energy_j >= last.energy_j:
            power = (now.energy_j - last.energy_j) / (now.at_s - last.at_s)
        return utilization, power


def _cpu_times(samples: Samples) -> tuple[float, float]:
    """(busy, all) CPU seconds over every core and mode."""
    busy = total = 0.0
    for sample in samples.get("node_cpu_seconds_total", ()):
        total += sample.value
        if sample.labels.get("mode") not in IDLE_MODES:
            busy += sample.value
    return busy, total


def _one(samples: Samples, name: str) -> float | None:
    found = samples.get(name)
    return found[0].value if found else None


def _sum(samples: Samples, name: str) -> float | None:
    found = samples.get(name)
    return sum(s.value for s in found) if found else None
