"""Topology: devices in hosts, hosts in racks, racks under a spine, and the links between them.

An :class:`Inventory` is plain, frozen data. It comes from an inventory file (format
``hlb-inventory/1``, documented in ``sim/data/README.md`` under "Inventory file") or from a
builder (:func:`build_cluster`, :func:`homogeneous_cluster`, :func:`mixed_cluster`,
:func:`pai_cluster`), and turns into hlb.v1 telemetry events with :meth:`Inventory.to_events`.

Links form a tree: every device hangs off its host (NVLink or PCIe, ``Host.device_link``), every
host off its rack switch (``Host.uplink``), every rack off its parent switch (``Switch.uplink``).
Bandwidths are in Gbit/s (``bandwidth_gbps``) and latencies in microseconds (``latency_us``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hlb.sim.catalogue import Catalogue, shared_data_dir
from hlb.v1 import events_pb2

INVENTORY_FORMAT = "hlb-inventory/1"
PAI_MACHINE_SPEC_PATH = Path(__file__).parent / "data" / "pai" / "pai_machine_spec.csv"

DEVICE_KINDS: dict[str, events_pb2.DeviceKind.ValueType] = {
    "gpu": events_pb2.DEVICE_KIND_GPU,
    "tpu": events_pb2.DEVICE_KIND_TPU,
    "fpga": events_pb2.DEVICE_KIND_FPGA,
    "asic": events_pb2.DEVICE_KIND_ASIC,
    "cpu": events_pb2.DEVICE_KIND_CPU,
}
# How tasks may share a device (docs/fractional.md); "" is exclusive.
SHARINGS: dict[str, events_pb2.DeviceSharing.ValueType] = {
    "": events_pb2.DEVICE_SHARING_UNSPECIFIED,
    "time_sliced": events_pb2.DEVICE_SHARING_TIME_SLICED,
    "mps": events_pb2.DEVICE_SHARING_MPS,
}
LINK_KINDS: dict[str, events_pb2.LinkKind.ValueType] = {
    "nvlink": events_pb2.LINK_KIND_NVLINK,
    "pcie": events_pb2.LINK_KIND_PCIE,
    "infiniband": events_pb2.LINK_KIND_INFINIBAND,
    "ethernet": events_pb2.LINK_KIND_ETHERNET,
}


@dataclass(frozen=True)
class LinkSpec:
    """What a link is made of: kind (nvlink, pcie, infiniband, ethernet), Gbit/s and µs."""

    kind: str
    bandwidth_gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link kind {self.kind!r} is not one of {sorted(LINK_KINDS)}")
        if self.bandwidth_gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"link bandwidth must be > 0 and latency >= 0, got {self}")


# Nominal figures: NVLink 2/3/4 aggregate per GPU (300/600/900 GB/s), PCIe 3.0 x16 (~16 GB/s),
# InfiniBand EDR/HDR/NDR, Ethernet. Latencies are typical one-hop figures.
NVLINK2 = LinkSpec("nvlink", 2400.0, 1.0)
NVLINK3 = LinkSpec("nvlink", 4800.0, 1.0)
NVLINK4 = LinkSpec("nvlink", 7200.0, 1.0)
PCIE3 = LinkSpec("pcie", 128.0, 1.5)
PCIE4 = LinkSpec("pcie", 256.0, 1.5)
ETHERNET_25G = LinkSpec("ethernet", 25.0, 10.0)
ETHERNET_100G = LinkSpec("ethernet", 100.0, 5.0)
INFINIBAND_100G = LinkSpec("infiniband", 100.0, 1.5)
INFINIBAND_200G = LinkSpec("infiniband", 200.0, 1.5)
INFINIBAND_400G = LinkSpec("infiniband", 400.0, 1.5)
SPINE_400G = LinkSpec("ethernet", 400.0, 3.0)


@dataclass(frozen=True)
class Device:
    """One accelerator; figures come from the catalogue profile of its model."""

    id: str
    host_id: str
    model: str
    kind: str
    memory_gb: float
    peak_tflops: float
    idle_power_w: float
    peak_power_w: float
    labels: Mapping[str, str] = field(default_factory=dict)
    # Fractional use (docs/fractional.md): a shareable device (``sharing`` "time_sliced" or "mps",
    # ``share_capacity_milli`` 0: 1000), or a partition of ``parent_id`` (a MIG instance) with its
    # compute share and profile; neither by default.
    sharing: str = ""
    share_capacity_milli: int = 0
    parent_id: str = ""
    partition_profile: str = ""
    compute_share_milli: int = 0

    def __post_init__(self) -> None:
        if self.sharing not in SHARINGS:
            raise ValueError(f"device {self.id!r}: sharing {self.sharing!r} is not one of {sorted(SHARINGS)[1:]}")
        if not 0 <= self.share_capacity_milli <= 10_000 or (self.share_capacity_milli and not self.sharing):
            raise ValueError(f"device {self.id!r}: share_capacity_milli needs sharing and is at most 10000")
        if self.parent_id and (self.sharing or not 1 <= self.compute_share_milli <= 1000):
            raise ValueError(f"device {self.id!r}: a partition has compute_share_milli 1..1000 and no sharing")
        if not self.parent_id and (self.compute_share_milli or self.partition_profile):
            raise ValueError(f"device {self.id!r}: compute_share_milli and partition_profile need parent_id")


@dataclass(frozen=True)
class Host:
    """A machine holding devices, attached to the rack switch ``rack_id``."""

    id: str
    rack_id: str
    cpu_cores: float
    memory_gb: float
    device_link: LinkSpec
    uplink: LinkSpec
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Switch:
    """A rack switch or a spine; ``uplink`` joins it to ``parent_id`` (None at the top)."""

    id: str
    parent_id: str = ""
    uplink: LinkSpec | None = None


@dataclass(frozen=True)
class Link:
    """A link between two endpoints (device, host or switch ids)."""

    id: str
    src_id: str
    dst_id: str
    spec: LinkSpec


@dataclass(frozen=True)
class Inventory:
    """Switches (parents first), hosts, devices, and extra links beyond the tree; ``nameplates``:
    the models the catalogue lacks, described by nameplate (model -> figures,
    :data:`hlb.sim.catalogue.NAMEPLATE_FIELDS`), whose profiles :meth:`catalogue` models."""

    switches: tuple[Switch, ...]
    hosts: tuple[Host, ...]
    devices: tuple[Device, ...]
    extra_links: tuple[Link, ...] = ()
    nameplates: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def catalogue(self, catalogue: Catalogue) -> Catalogue:
        """``catalogue`` with a modelled profile for each of this inventory's nameplates."""
        return catalogue.with_nameplates(self.nameplates)

    def __post_init__(self) -> None:
        switch_ids = {s.id for s in self.switches}
        host_ids = {h.id for h in self.hosts}
        ids = [s.id for s in self.switches] + [h.id for h in self.hosts] + [d.id for d in self.devices]
        if len(ids) != len(set(ids)):
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate ids in inventory: {duplicates[:5]}")
        for switch in self.switches:
            if switch.parent_id and switch.parent_id not in switch_ids:
                raise ValueError(f"switch {switch.id!r}: unknown parent {switch.parent_id!r}")
        for host in self.hosts:
            if host.rack_id not in switch_ids:
                raise ValueError(f"host {host.id!r}: unknown rack {host.rack_id!r}")
        devices = {d.id: d for d in self.devices}
        for device in self.devices:
            if device.host_id not in host_ids:
                raise ValueError(f"device {device.id!r}: unknown host {device.host_id!r}")
            parent = devices.get(device.parent_id) if device.parent_id else None
            if device.parent_id and (
                parent is None or parent.host_id != device.host_id or parent.sharing or parent.parent_id
            ):
                raise ValueError(
                    f"device {device.id!r}: parent {device.parent_id!r} must be an exclusive, whole device on its host"
                )

    @property
    def links(self) -> tuple[Link, ...]:
        """Every link: device-host, host-rack, switch-parent, then the extra links."""
        hosts = {h.id: h for h in self.hosts}
        tree = [Link(f"{d.id}~{d.host_id}", d.id, d.host_id, hosts[d.host_id].device_link) for d in self.devices]
        tree += [Link(f"{h.id}~{h.rack_id}", h.id, h.rack_id, h.uplink) for h in self.hosts]
        tree += [
            Link(f"{s.id}~{s.parent_id}", s.id, s.parent_id, s.uplink)
            for s in self.switches
            if s.parent_id and s.uplink is not None
        ]
        return (*tree, *self.extra_links)

    def device_count(self, model: str | None = None) -> int:
        return sum(1 for d in self.devices if model is None or d.model == model)

    def physical_device_count(self) -> int:
        """Devices counted once each: a MIG partition is part of its parent, not a device of its own."""
        return sum(1 for d in self.devices if not d.parent_id)

    @property
    def shares_devices(self) -> bool:
        """Whether some device is shareable (MPS, time slicing) or partitioned (MIG)."""
        return any(d.sharing or d.parent_id for d in self.devices)

    def to_events(
        self, cell: str, event_time_ms: int = 0, source: str = "hlb.sim.topology"
    ) -> list[events_pb2.TelemetryEvent]:
        """Upsert events in an order that never names an entity before it exists."""
        events: list[events_pb2.TelemetryEvent] = []

        def event() -> events_pb2.TelemetryEvent:
            message = events_pb2.TelemetryEvent(cell=cell, event_time_ms=event_time_ms, source=source)
            events.append(message)
            return message

        for switch in self.switches:
            event().switch_upsert.CopyFrom(events_pb2.Switch(id=switch.id, parent_id=switch.parent_id))
        for host in self.hosts:
            event().host_upsert.CopyFrom(
                events_pb2.Host(
                    id=host.id,
                    rack_id=host.rack_id,
                    cpu_cores=host.cpu_cores,
                    memory_gb=host.memory_gb,
                    labels=dict(host.labels),
                )
            )
        for device in self.devices:
            event().device_upsert.CopyFrom(
                events_pb2.Device(
                    id=device.id,
                    host_id=device.host_id,
                    kind=DEVICE_KINDS[device.kind],
                    model=device.model,
                    memory_gb=device.memory_gb,
                    peak_tflops=device.peak_tflops,
                    idle_power_w=device.idle_power_w,
                    peak_power_w=device.peak_power_w,
                    labels=dict(device.labels),
                    sharing=SHARINGS[device.sharing],
                    share_capacity_milli=device.share_capacity_milli,
                    parent_id=device.parent_id,
                    partition_profile=device.partition_profile,
                    compute_share_milli=device.compute_share_milli,
                )
            )
        for link in self.links:
            event().link_upsert.CopyFrom(
                events_pb2.Link(
                    id=link.id,
                    src_id=link.src_id,
                    dst_id=link.dst_id,
                    kind=LINK_KINDS[link.spec.kind],
                    bandwidth_gbps=link.spec.bandwidth_gbps,
                    latency_us=link.spec.latency_us,
                )
            )
        return events


def device_from_catalogue(
    catalogue: Catalogue, device_id: str, host_id: str, model: str, labels: Mapping[str, str] | None = None
) -> Device:
    """A device of ``model`` with the catalogue's memory, peak TFLOPS and power."""
    profile = catalogue.profile(model)
    return Device(
        id=device_id,
        host_id=host_id,
        model=model,
        kind=profile.kind,
        memory_gb=profile.memory_gb,
        peak_tflops=profile.peak_tflops,
        idle_power_w=profile.idle_power_w,
        peak_power_w=profile.peak_power_w,
        labels=dict(labels or {}),
    )


# ---------------------------------------------------------------- inventory file


def load_inventory(path: Path | str, catalogue: Catalogue) -> Inventory:
    """Read an ``hlb-inventory/1`` JSON file; device figures come from ``catalogue``."""
    path = Path(path)
    try:
        return inventory_from_document(json.loads(path.read_text()), catalogue)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a valid inventory file: {error}") from error


def write_inventory(path: Path | str, inventory: Inventory) -> None:
    Path(path).write_text(json.dumps(inventory_to_document(inventory), indent=1) + "\n")


def inventory_from_document(document: Mapping[str, Any], catalogue: Catalogue) -> Inventory:
    if document.get("format") != INVENTORY_FORMAT:
        raise ValueError(f"format is {document.get('format')!r}, expected {INVENTORY_FORMAT!r}")
    switches = tuple(
        Switch(s["id"], s.get("parent", ""), _link_spec(s["uplink"]) if "uplink" in s else None)
        for s in document["switches"]
    )
    nameplates = {str(model): dict(figures) for model, figures in document.get("nameplates", {}).items()}
    catalogue = catalogue.with_nameplates(nameplates)
    hosts: list[Host] = []
    devices: list[Device] = []
    for entry in document["hosts"]:
        host = Host(
            id=entry["id"],
            rack_id=entry["rack"],
            cpu_cores=float(entry.get("cpu_cores", 0.0)),
            memory_gb=float(entry.get("memory_gb", 0.0)),
            device_link=_link_spec(
                entry.get("device_link", {"kind": "pcie", "bandwidth_gbps": 128.0, "latency_us": 1.5})
            ),
            uplink=_link_spec(entry["uplink"]),
            labels=dict(entry.get("labels", {})),
        )
        hosts.append(host)
        on_host = 0
        for group in entry.get("devices", []):
            if "count" in group:
                ids = [f"{host.id}/dev{on_host + i}" for i in range(int(group["count"]))]
            else:
                ids = [str(group["id"])]
            on_host += len(ids)
            for device_id in ids:
                device = device_from_catalogue(catalogue, device_id, host.id, group["model"], group.get("labels"))
                device = replace(
                    device,
                    sharing=str(group.get("sharing", "")),
                    share_capacity_milli=int(group.get("share_capacity_milli", 0)),
                )
                devices += [device, *_partitions(device, group.get("partitions", []))]
    extra = tuple(Link(link["id"], link["src"], link["dst"], _link_spec(link)) for link in document.get("links", []))
    return Inventory(switches, tuple(hosts), tuple(devices), extra, nameplates)


def inventory_to_document(inventory: Inventory) -> dict[str, Any]:
    """The file form: every device written with its id, so that reading it back is exact."""
    by_host: dict[str, list[Device]] = {}
    partitions_of: dict[str, list[Device]] = {}
    for device in inventory.devices:
        by_host.setdefault(device.host_id, []).append(device)
        if device.parent_id:
            partitions_of.setdefault(device.parent_id, []).append(device)
    switches: list[dict[str, Any]] = []
    for switch in inventory.switches:
        entry: dict[str, Any] = {"id": switch.id}
        if switch.parent_id:
            entry["parent"] = switch.parent_id
        if switch.uplink is not None:
            entry["uplink"] = _link_dict(switch.uplink)
        switches.append(entry)
    hosts: list[dict[str, Any]] = []
    for host in inventory.hosts:
        entry = {
            "id": host.id,
            "rack": host.rack_id,
            "cpu_cores": host.cpu_cores,
            "memory_gb": host.memory_gb,
            "device_link": _link_dict(host.device_link),
            "uplink": _link_dict(host.uplink),
        }
        if host.labels:
            entry["labels"] = dict(host.labels)
        entry["devices"] = [_device_entry(d, partitions_of) for d in by_host.get(host.id, []) if not d.parent_id]
        hosts.append(entry)
    links = [{"id": k.id, "src": k.src_id, "dst": k.dst_id, **_link_dict(k.spec)} for k in inventory.extra_links]
    document: dict[str, Any] = {"format": INVENTORY_FORMAT}
    if inventory.nameplates:
        document["nameplates"] = {model: dict(figures) for model, figures in inventory.nameplates.items()}
    return document | {"switches": switches, "hosts": hosts, "links": links}


def _partitions(parent: Device, entries: Sequence[Mapping[str, Any]]) -> list[Device]:
    """The partitions (MIG instances) an inventory entry cuts ``parent`` into: each ``{"profile",
    "memory_gb", "compute_share_milli"}`` with ``"count"`` (ids ``<parent>/mig<N>``) or ``"id"``.
    A partition draws no idle power of its own (its parent's counts once) and its compute share
    of the parent's dynamic power and peak TFLOPS."""
    out: list[Device] = []
    for entry in entries:
        ids = (
            [f"{parent.id}/mig{len(out) + i}" for i in range(int(entry["count"]))]
            if "count" in entry
            else [str(entry["id"])]
        )
        share = int(entry["compute_share_milli"])
        for device_id in ids:
            out.append(
                replace(
                    parent,
                    id=device_id,
                    memory_gb=float(entry["memory_gb"]),
                    peak_tflops=parent.peak_tflops * share / 1000,
                    idle_power_w=0.0,
                    peak_power_w=(parent.peak_power_w - parent.idle_power_w) * share / 1000,
                    labels=dict(entry.get("labels", {})),
                    sharing="",
                    share_capacity_milli=0,
                    parent_id=parent.id,
                    partition_profile=str(entry.get("profile", "")),
                    compute_share_milli=share,
                )
            )
    return out


def _device_entry(device: Device, partitions_of: Mapping[str, Sequence[Device]]) -> dict[str, Any]:
    """A whole device's file entry, its partitions nested in it (read back exactly)."""
    entry: dict[str, Any] = {"id": device.id, "model": device.model}
    if device.labels:
        entry["labels"] = dict(device.labels)
    if device.sharing:
        entry["sharing"] = device.sharing
    if device.share_capacity_milli:
        entry["share_capacity_milli"] = device.share_capacity_milli
    partitions = [
        {
            "id": p.id,
            "profile": p.partition_profile,
            "memory_gb": p.memory_gb,
            "compute_share_milli": p.compute_share_milli,
            **({"labels": dict(p.labels)} if p.labels else {}),
        }
        for p in partitions_of.get(device.id, ())
    ]
    if partitions:
        entry["partitions"] = partitions
    return entry


def _link_spec(entry: Mapping[str, Any]) -> LinkSpec:
    return LinkSpec(str(entry["kind"]), float(entry["bandwidth_gbps"]), float(entry["latency_us"]))


def _link_dict(spec: LinkSpec) -> dict[str, Any]:
    return {"kind": spec.kind, "bandwidth_gbps": spec.bandwidth_gbps, "latency_us": spec.latency_us}


# ---------------------------------------------------------------- builders


@dataclass(frozen=True)
class HostShape:
    """A kind of machine: which devices it holds and how they and it are connected."""

    model: str
    devices_per_host: int
    cpu_cores: float
    memory_gb: float
    device_link: LinkSpec
    uplink: LinkSpec


# Typical server shapes per model (DGX-1/DGX A100/DGX H100/HGX H200-like for SXM parts, 8-OAM
# MI300X platforms, 4-8 card PCIe servers otherwise, TPU v4/v5e hosts with 4 chips, Gaudi2 HLS with 8 OAMs).
STANDARD_HOST_SHAPES: dict[str, HostShape] = {
    "V100-SXM2-16GB": HostShape("V100-SXM2-16GB", 8, 64, 488, NVLINK2, INFINIBAND_100G),
    "V100-SXM2-32GB": HostShape("V100-SXM2-32GB", 8, 96, 768, NVLINK2, INFINIBAND_100G),
    "P100-PCIE-16GB": HostShape("P100-PCIE-16GB", 4, 32, 244, PCIE3, ETHERNET_25G),
    "K80-GK210": HostShape("K80-GK210", 8, 32, 488, PCIE3, ETHERNET_25G),
    "A100-SXM4-80GB": HostShape("A100-SXM4-80GB", 8, 128, 2048, NVLINK3, INFINIBAND_200G),
    "H100-SXM5-80GB": HostShape("H100-SXM5-80GB", 8, 112, 2048, NVLINK4, INFINIBAND_400G),
    "T4": HostShape("T4", 4, 48, 192, PCIE3, ETHERNET_25G),
    "A10": HostShape("A10", 4, 64, 512, PCIE4, ETHERNET_100G),
    "L4": HostShape("L4", 8, 64, 512, PCIE4, ETHERNET_100G),
    "L40S": HostShape("L40S", 8, 96, 1024, PCIE4, ETHERNET_100G),
    "H200-SXM-141GB": HostShape("H200-SXM-141GB", 8, 112, 2048, NVLINK4, INFINIBAND_400G),
    # Infinity Fabric (xGMI) joins the 8 OAMs at 896 GB/s per GPU; hlb.v1 has no kind for it, and it
    # plays NVLink's part.
    "MI300X": HostShape("MI300X", 8, 128, 2048, LinkSpec("nvlink", 7168.0, 1.0), INFINIBAND_400G),
    "TPU-v4": HostShape("TPU-v4", 4, 240, 400, PCIE4, ETHERNET_100G),
    "TPU-v5e": HostShape("TPU-v5e", 4, 112, 192, PCIE4, ETHERNET_100G),
    "Gaudi2-HL225H": HostShape("Gaudi2-HL225H", 8, 160, 1024, LinkSpec("ethernet", 2100.0, 2.0), ETHERNET_100G),
    "Alveo-U280": HostShape("Alveo-U280", 4, 32, 256, PCIE3, ETHERNET_100G),
}


def build_cluster(
    catalogue: Catalogue,
    host_groups: Sequence[tuple[HostShape, int]],
    hosts_per_rack: int = 16,
    rack_uplink: LinkSpec = SPINE_400G,
    host_labels: Sequence[Mapping[str, str]] | None = None,
) -> Inventory:
    """Racks under one spine, filled with hosts in the given order (``(shape, host count)``).

    Host ids are ``rack-RRR/host-HH``; device ids ``<host>/devN``. A rack holds one device model
    only (hosts without devices count as a model of their own), so that a rack is a homogeneous
    failure and bandwidth domain.
    """
    if hosts_per_rack < 1:
        raise ValueError("hosts_per_rack must be >= 1")
    switches: list[Switch] = [Switch("spine")]
    hosts: list[Host] = []
    devices: list[Device] = []
    labels_iter = iter(host_labels) if host_labels is not None else None
    rack_model, rack_fill = None, hosts_per_rack
    for shape, count in host_groups:
        for _ in range(count):
            if rack_fill == hosts_per_rack or shape.model != rack_model:
                switches.append(Switch(f"rack-{len(switches) - 1:03d}", "spine", rack_uplink))
                rack_model, rack_fill = shape.model, 0
            rack = switches[-1].id
            host_id = f"{rack}/host-{rack_fill:02d}"
            rack_fill += 1
            labels = dict(next(labels_iter)) if labels_iter is not None else {}
            hosts.append(Host(host_id, rack, shape.cpu_cores, shape.memory_gb, shape.device_link, shape.uplink, labels))
            devices += [
                device_from_catalogue(catalogue, f"{host_id}/dev{i}", host_id, shape.model)
                for i in range(shape.devices_per_host)
            ]
    return Inventory(tuple(switches), tuple(hosts), tuple(devices))


def homogeneous_cluster(catalogue: Catalogue, model: str, num_devices: int, hosts_per_rack: int = 16) -> Inventory:
    """``num_devices`` devices of one model on its standard hosts (the last host may hold fewer)."""
    return mixed_cluster(catalogue, {model: num_devices}, hosts_per_rack)


def mixed_cluster(catalogue: Catalogue, devices_per_model: Mapping[str, int], hosts_per_rack: int = 16) -> Inventory:
    """A heterogeneous cluster: per model, full standard hosts and one partly filled host."""
    groups: list[tuple[HostShape, int]] = []
    for model, count in devices_per_model.items():
        shape = STANDARD_HOST_SHAPES[model]
        full_hosts, remainder = divmod(count, shape.devices_per_host)
        groups.append((shape, full_hosts))
        if remainder:
            groups.append((replace(shape, devices_per_host=remainder), 1))
    return build_cluster(catalogue, groups, hosts_per_rack)


def sample_inventory(inventory: Inventory, devices: int, seed: int = 0) -> Inventory:
    """About ``devices`` devices' worth of whole hosts drawn from ``inventory``, keeping its mix.

    Hosts are grouped by what they hold (models and counts); each group keeps its share of the
    devices, rounded to whole hosts (largest remainders), and its hosts are drawn uniformly
    without replacement with ``seed``. Hosts without devices are left out; switches without a
    kept host below them and extra links to dropped endpoints go too. Order is kept.
    """
    total = len(inventory.devices)
    if not 1 <= devices <= total:
        raise ValueError(f"a sample needs 1 to {total} devices (the inventory's), got {devices}")
    on_host: dict[str, list[str]] = {}
    for device in inventory.devices:
        on_host.setdefault(device.host_id, []).append(device.model)
    groups: dict[tuple[str, ...], list[str]] = {}
    for host in inventory.hosts:
        if on_host.get(host.id):
            groups.setdefault(tuple(sorted(on_host[host.id])), []).append(host.id)
    want = {key: devices * len(hosts) / total for key, hosts in groups.items()}  # hosts to keep
    counts = {key: int(value) for key, value in want.items()}
    short = round(sum(want.values())) - sum(counts.values())
    for key in sorted(want, key=lambda k: counts[k] - want[k])[: max(0, short)]:
        counts[key] += 1
    rng = np.random.default_rng(seed)
    kept_hosts: set[str] = set()
    for key, hosts in groups.items():
        kept_hosts.update(hosts[i] for i in rng.choice(len(hosts), size=min(counts[key], len(hosts)), replace=False))
    hosts_kept = tuple(h for h in inventory.hosts if h.id in kept_hosts)
    parents = {s.id: s.parent_id for s in inventory.switches}
    kept_switches: set[str] = set()
    for host in hosts_kept:
        switch = host.rack_id
        while switch and switch not in kept_switches:
            kept_switches.add(switch)
            switch = parents.get(switch, "")
    kept_devices = tuple(d for d in inventory.devices if d.host_id in kept_hosts)
    endpoints = kept_hosts | kept_switches | {d.id for d in kept_devices}
    return Inventory(
        tuple(s for s in inventory.switches if s.id in kept_switches),
        hosts_kept,
        kept_devices,
        tuple(k for k in inventory.extra_links if k.src_id in endpoints and k.dst_id in endpoints),
        inventory.nameplates,
    )


# Gavel's simulated heterogeneous cluster (traces/msr/cluster_specs_heterogeneous.json, "300:300:300"
# = V100:P100:K80 GPUs).
GAVEL_HETEROGENEOUS_DEVICES: dict[str, int] = {"V100-SXM2-16GB": 300, "P100-PCIE-16GB": 300, "K80-GK210": 300}

# PAI gpu_type -> catalogue model. MISC machines hold older K40m/K80/M60 cards; they are modelled
# as Gavel's K80 (the oldest generation measured). The network is not published: hosts get the
# standard shape's links (an assumption) and racks of 16 hosts of one gpu_type.
PAI_MODELS: dict[str, str] = {
    "V100": "V100-SXM2-16GB",
    "V100M32": "V100-SXM2-32GB",
    "P100": "P100-PCIE-16GB",
    "T4": "T4",
    "MISC": "K80-GK210",
}


def pai_cluster(catalogue: Catalogue, spec_path: Path = PAI_MACHINE_SPEC_PATH, hosts_per_rack: int = 16) -> Inventory:
    """The Alibaba PAI GPU cluster (v2020 trace) from its machine spec table.

    One host per machine row (``machine, gpu_type, cap_cpu, cap_mem, cap_gpu``; no header), with
    ``cap_gpu`` devices; CPU-only machines become hosts without devices. Hosts keep the machine
    hash and gpu_type as labels ``pai_machine`` and ``pai_gpu_type``.
    """
    with spec_path.open(newline="") as handle:
        rows = [row for row in csv.reader(handle) if row]
    by_type: dict[str, list[list[str]]] = {}
    for row in rows:
        by_type.setdefault(row[1], []).append(row)
    groups: list[tuple[HostShape, int]] = []
    labels: list[dict[str, str]] = []
    for gpu_type in sorted(by_type):
        for shape, members in _pai_shapes(gpu_type, by_type[gpu_type]):
            groups.append((shape, len(members)))
            labels += [{"pai_machine": row[0], "pai_gpu_type": gpu_type} for row in members]
    return build_cluster(catalogue, groups, hosts_per_rack, host_labels=labels)


def _pai_shapes(gpu_type: str, rows: Iterable[list[str]]) -> list[tuple[HostShape, list[list[str]]]]:
    """Group one gpu_type's machines by (cores, memory, GPUs), each group one host shape."""
    shapes: dict[tuple[float, float, int], list[list[str]]] = {}
    for row in rows:
        shapes.setdefault((float(row[2]), float(row[3]), int(row[4])), []).append(row)
    result = []
    for (cpu, memory, gpus), members in sorted(shapes.items()):
        if gpu_type == "CPU" or gpus == 0:
            shape = HostShape("", 0, cpu, memory, PCIE3, ETHERNET_25G)
        else:
            standard = STANDARD_HOST_SHAPES[PAI_MODELS[gpu_type]]
            shape = HostShape(standard.model, gpus, cpu, memory, standard.device_link, standard.uplink)
        result.append((shape, members))
    return result


def shared_pai_machine_spec() -> Path:
    """The PAI machine spec table in the public data folder (may not exist)."""
    return shared_data_dir() / "alibaba-pai-gpu-v2020" / "pai_machine_spec.csv"
