"""What a source reads off a host, in hlb's units, and the interface every source has.

A source converts its own units (percent, MiB, mW, bytes) before it hands a reading over: a
``DeviceReading`` holds utilization as a fraction in [0, 1], memory in GiB (MiB / 1024, as
nameplates count device memory), power in W and temperatures in °C, so that what the host agent
publishes passes the daemon's checks unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from hlb.v1 import events_pb2 as ev

MIB_PER_GIB = 1024.0
BYTES_PER_GIB = 1024.0**3

# Xid errors after which a GPU cannot be trusted with work until it is reset or drained (NVIDIA's
# Xid catalogue: double-bit ECC, row-remapping failures, NVLink errors, fallen off the bus,
# contained and uncontained ECC, GSP errors); any other Xid (an application's fault, mostly)
# degrades it.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
# Clock event (throttle) reasons that slow a device down from outside the task: hardware
# slowdown, hardware thermal slowdown, power brake (NVML's nvmlClocksEventReason* bits).
SLOWDOWN_REASONS = 0x8 | 0x40 | 0x80


@dataclass(frozen=True)
class RunningTask:
    """An hlb task seen running on a device: its id and the placement it runs under (0: unknown)."""

    task_id: str
    placement_sequence: int = 0


@dataclass
class DeviceReading:
    """One device as a source read it, in hlb's units (see the module docstring)."""

    id: str  # stable: a GPU's UUID, else its PCI bus id, else <host>/<kind><index>
    kind: ev.DeviceKind.ValueType
    vendor_model: str  # the name the vendor's tools give, e.g. "NVIDIA H100 80GB HBM3"
    memory_gb: float
    memory_used_gb: float = 0.0
    utilization: float = 0.0
    power_w: float = 0.0
    power_limit_w: float = 0.0  # 0: not known
    temperature_c: float = 0.0
    health: ev.Health.ValueType = ev.HEALTH_HEALTHY
    health_reason: str = ""
    tasks: tuple[RunningTask, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkReading:
    """An interconnect link a source found: between two devices (NVLink), or from a device to its
    host (PCIe; ``dst_id`` empty: the host the agent reports). Bandwidth in Gbit/s, both
    directions, as the inventory counts it."""

    id: str
    src_id: str
    dst_id: str
    kind: ev.LinkKind.ValueType
    bandwidth_gbps: float
    latency_us: float


@dataclass
class HostReading:
    id: str
    cpu_cores: float = 0.0
    memory_gb: float = 0.0


@dataclass
class Reading:
    """One read of a source: the host (when the source knows it) and its devices."""

    host: HostReading | None = None
    devices: list[DeviceReading] = field(default_factory=list)
    links: list[LinkReading] = field(default_factory=list)


class Source(Protocol):
    """Reads the host now. ``name`` says which source in logs; ``read`` raises ``SourceError``
    when the source cannot be read this time (the agent logs it and tries again next interval)."""

    name: str

    def read(self) -> Reading: ...


class SourceError(Exception):
    """A source could not be read: an endpoint down, NVML not loaded, a reply that is not its format."""


def fraction(percent: float) -> float:
    """A percentage as a fraction, clipped to [0, 1] (tools report 100.4 % now and then)."""
    return min(1.0, max(0.0, percent / 100.0))


def health_of(
    xid: int = 0, uncorrectable_ecc: float = 0.0, remap_failed: float = 0.0, slowdown_reasons: int = 0
) -> tuple[ev.Health.ValueType, str]:
    """A device's health from its error counters: failed on uncorrectable ECC errors, a failed row
    remap or a fatal Xid; degraded on any other Xid or a slowdown forced on it; else healthy."""
    if uncorrectable_ecc > 0:
        return ev.HEALTH_FAILED, f"{uncorrectable_ecc:g} uncorrectable ECC errors"
    if remap_failed > 0:
        return ev.HEALTH_FAILED, "a memory row remap failed"
    if xid in FATAL_XIDS:
        return ev.HEALTH_FAILED, f"Xid {xid}"
    if xid:
        return ev.HEALTH_DEGRADED, f"Xid {xid}"
    if slowdown_reasons & SLOWDOWN_REASONS:
        return ev.HEALTH_DEGRADED, f"clocks slowed down (reasons 0x{slowdown_reasons:x})"
    return ev.HEALTH_HEALTHY, ""


def task_from_label(value: str) -> RunningTask | None:
    """An executor's label naming a task: ``<task id>`` or ``<task id>@<placement sequence>``."""
    value = value.strip()
    if not value or value == "0":  # dcgm-exporter's job mapping writes no job as empty or 0
        return None
    task_id, at, sequence = value.rpartition("@")
    if at and task_id and sequence.isdigit():
        return RunningTask(task_id, int(sequence))
    return RunningTask(value)


def labels_of(sample_labels: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    return {k: sample_labels[k] for k in keys if sample_labels.get(k)}
