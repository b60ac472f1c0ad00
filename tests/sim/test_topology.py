"""Inventories: the file format, the builders, and their hlb.v1 telemetry events."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.topology import (
    GAVEL_HETEROGENEOUS_DEVICES,
    PAI_MACHINE_SPEC_PATH,
    Inventory,
    homogeneous_cluster,
    inventory_from_document,
    inventory_to_document,
    load_inventory,
    mixed_cluster,
    pai_cluster,
    sample_inventory,
    shared_pai_machine_spec,
    write_inventory,
)
from hlb.v1 import events_pb2

FIXTURE = Path(__file__).parent / "fixtures" / "small_inventory.json"


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return load_catalogue()


@pytest.fixture(scope="module")
def small(catalogue: Catalogue) -> Inventory:
    return load_inventory(FIXTURE, catalogue)


def test_the_hand_written_inventory_loads(small: Inventory) -> None:
    assert [s.id for s in small.switches] == ["spine", "rack-a", "rack-b"]
    assert [h.id for h in small.hosts] == ["a1", "a2", "b1"]
    assert [d.id for d in small.devices] == [
        "a1/dev0",
        "a1/dev1",
        "a1/dev2",
        "a1/dev3",
        "a2/t4-left",
        "a2/t4-right",
        "b1/dev0",
        "b1/fpga",
    ]
    assert small.device_count("V100-SXM2-16GB") == 4
    assert small.hosts[0].labels == {"zone": "a"}
    assert small.devices[5].labels == {"slot": "2"}


def test_device_figures_come_from_the_catalogue(small: Inventory, catalogue: Catalogue) -> None:
    tpu = next(d for d in small.devices if d.model == "TPU-v4")
    profile = catalogue.profile("TPU-v4")
    assert (tpu.kind, tpu.memory_gb, tpu.peak_tflops) == ("tpu", 32.0, 275.0)
    assert (tpu.idle_power_w, tpu.peak_power_w) == (profile.idle_power_w, profile.peak_power_w)


def test_links_follow_the_tree_plus_extra_links(small: Inventory) -> None:
    links = {link.id: link for link in small.links}
    assert len(links) == 8 + 3 + 2 + 1
    nvlink = links["a1/dev2~a1"]
    assert (nvlink.spec.kind, nvlink.spec.bandwidth_gbps, nvlink.spec.latency_us) == ("nvlink", 2400.0, 1.0)
    # b1 names no device_link: PCIe 3.0 x16 by default.
    assert links["b1/fpga~b1"].spec.kind == "pcie"
    assert links["a2~rack-a"].spec.bandwidth_gbps == 25.0
    assert (links["rack-b~spine"].src_id, links["rack-b~spine"].dst_id) == ("rack-b", "spine")
    assert links["a1~b1"].spec.kind == "infiniband"


def test_the_inventory_round_trips_through_its_file(small: Inventory, catalogue: Catalogue, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    write_inventory(path, small)
    again = load_inventory(path, catalogue)
    assert again == small
    written = json.loads(path.read_text())
    assert written["hosts"][0]["devices"][0] == {"id": "a1/dev0", "model": "V100-SXM2-16GB"}


def test_a_built_cluster_round_trips_too(catalogue: Catalogue, tmp_path: Path) -> None:
    cluster = mixed_cluster(catalogue, {"A100-SXM4-80GB": 12, "Gaudi2-HL225H": 8})
    path = tmp_path / "cluster.json"
    write_inventory(path, cluster)
    assert load_inventory(path, catalogue) == cluster


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["hosts"][0]["devices"].append({"id": "x", "model": "MI400X"}), "MI400X"),
        (lambda d: d["hosts"][1].update(rack="rack-z"), "rack-z"),
        (lambda d: d["hosts"][1]["devices"].append({"id": "a1/dev0", "model": "T4"}), "duplicate"),
        (lambda d: d["hosts"][0]["uplink"].update(kind="carrier-pigeon"), "carrier-pigeon"),
        (lambda d: d.update(format="hlb-inventory/0"), "format"),
    ],
)
def test_a_broken_inventory_is_refused_with_a_reason(
    catalogue: Catalogue, tmp_path: Path, edit: object, message: str
) -> None:
    document = json.loads(FIXTURE.read_text())
    assert callable(edit)
    edit(document)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=message):
        load_inventory(path, catalogue)


def test_events_upsert_every_entity_after_what_it_names(small: Inventory) -> None:
    events = small.to_events("cell-7", event_time_ms=1234)
    kinds = Counter(e.WhichOneof("payload") for e in events)
    assert kinds == {"switch_upsert": 3, "host_upsert": 3, "device_upsert": 8, "link_upsert": 14}
    assert all(e.cell == "cell-7" and e.event_time_ms == 1234 for e in events)
    seen: set[str] = set()
    for event in events:
        field = event.WhichOneof("payload")
        assert field is not None
        payload = getattr(event, field)
        if isinstance(payload, events_pb2.Switch) and payload.parent_id:
            assert payload.parent_id in seen
        if isinstance(payload, events_pb2.Host):
            assert payload.rack_id in seen
        if isinstance(payload, events_pb2.Device):
            assert payload.host_id in seen
        if isinstance(payload, events_pb2.Link):
            assert {payload.src_id, payload.dst_id} <= seen
        seen.add(payload.id)


def test_a_device_event_carries_kind_and_figures(small: Inventory) -> None:
    devices = [e.device_upsert for e in small.to_events("c") if e.HasField("device_upsert")]
    fpga = next(d for d in devices if d.id == "b1/fpga")
    assert fpga.kind == events_pb2.DEVICE_KIND_FPGA
    assert (fpga.model, fpga.memory_gb, fpga.peak_power_w) == ("Alveo-U280", 8.0, 225.0)
    links = [e.link_upsert for e in small.to_events("c") if e.HasField("link_upsert")]
    assert next(k for k in links if k.id == "a1/dev0~a1").kind == events_pb2.LINK_KIND_NVLINK


def test_a_homogeneous_cluster_has_exactly_the_devices_asked_for(catalogue: Catalogue) -> None:
    cluster = homogeneous_cluster(catalogue, "H100-SXM5-80GB", 20)
    assert cluster.device_count("H100-SXM5-80GB") == 20
    assert len(cluster.hosts) == 3  # 8 + 8 + 4
    assert [sum(1 for d in cluster.devices if d.host_id == h.id) for h in cluster.hosts] == [8, 8, 4]


def test_gavels_heterogeneous_cluster_keeps_racks_of_one_model(catalogue: Catalogue) -> None:
    cluster = mixed_cluster(catalogue, GAVEL_HETEROGENEOUS_DEVICES, hosts_per_rack=16)
    assert {m: cluster.device_count(m) for m in GAVEL_HETEROGENEOUS_DEVICES} == GAVEL_HETEROGENEOUS_DEVICES
    hosts = {h.id: h for h in cluster.hosts}
    models_per_rack: dict[str, set[str]] = {}
    for device in cluster.devices:
        models_per_rack.setdefault(hosts[device.host_id].rack_id, set()).add(device.model)
    assert all(len(models) == 1 for models in models_per_rack.values())
    assert max(Counter(h.rack_id for h in cluster.hosts).values()) == 16


def test_the_pai_cluster_has_the_machine_tables_gpus(catalogue: Catalogue) -> None:
    cluster = pai_cluster(catalogue)
    assert cluster.device_count() == 6742
    assert len(cluster.hosts) == 1897
    assert {m: cluster.device_count(m) for m in {d.model for d in cluster.devices}} == {
        "V100-SXM2-16GB": 832,
        "V100-SXM2-32GB": 1080,
        "P100-PCIE-16GB": 1596,
        "T4": 994,
        "K80-GK210": 2240,
    }
    cpu_hosts = [h for h in cluster.hosts if h.labels["pai_gpu_type"] == "CPU"]
    assert len(cpu_hosts) == 83


def test_the_pai_cluster_from_shared_data_matches_the_spec_file(catalogue: Catalogue) -> None:
    spec = shared_pai_machine_spec()
    if not spec.is_file():
        pytest.skip(f"public data not found at {spec} (set HLB_SHARED_DATA)")
    gpus_in_file = sum(int(line.split(",")[4]) for line in spec.read_text().splitlines() if line)
    assert gpus_in_file == 6742  # docs/design.md §6
    assert pai_cluster(catalogue, spec).device_count() == gpus_in_file
    assert spec.read_bytes() == PAI_MACHINE_SPEC_PATH.read_bytes()


def test_the_written_document_lists_devices_by_id(small: Inventory) -> None:
    document = inventory_to_document(small)
    assert sum(len(h["devices"]) for h in document["hosts"]) == 8
    assert all("count" not in d for h in document["hosts"] for d in h["devices"])


def test_an_inventory_loads_from_a_string_path_too(small: Inventory, catalogue: Catalogue) -> None:
    assert load_inventory(str(FIXTURE), catalogue) == small


def test_a_sample_of_the_pai_cluster_keeps_its_device_mix(catalogue: Catalogue) -> None:
    cluster = pai_cluster(catalogue)
    sample = sample_inventory(cluster, 3000, seed=1)
    models = Counter(d.model for d in cluster.devices)
    kept = Counter(d.model for d in sample.devices)
    assert abs(sample.device_count() - 3000) <= 8  # whole hosts of up to 8 devices
    for model, count in models.items():
        assert kept[model] / sample.device_count() == pytest.approx(count / cluster.device_count(), abs=0.01)
    hosts = {h.id for h in sample.hosts}
    assert all(d.host_id in hosts for d in sample.devices)
    assert all(h.labels["pai_gpu_type"] != "CPU" for h in sample.hosts)
    assert {s.id for s in sample.switches} >= {h.rack_id for h in sample.hosts} | {"spine"}
    assert sample_inventory(cluster, 3000, seed=1) == sample
    assert sample_inventory(cluster, 3000, seed=2) != sample


def test_a_sample_larger_than_the_cluster_is_refused(small: Inventory) -> None:
    with pytest.raises(ValueError, match="1 to 8"):
        sample_inventory(small, 9)


NAMEPLATE = {"kind": "gpu", "memory_gb": 32.0, "memory_bandwidth_gbs": 1000.0, "peak_tflops": 200.0, "tdp_w": 300.0}


def nameplate_inventory() -> dict[str, Any]:
    """One host of two devices of a model the catalogue lacks, described by nameplate, and one V100."""
    link = {"kind": "pcie", "bandwidth_gbps": 256, "latency_us": 1.5}
    return {
        "format": "hlb-inventory/1",
        "nameplates": {"Acme-X1": NAMEPLATE},
        "switches": [{"id": "rack"}],
        "hosts": [
            {"id": "h", "rack": "rack", "uplink": link, "devices": [{"model": "Acme-X1", "count": 2}]},
            {"id": "v", "rack": "rack", "uplink": link, "devices": [{"model": "V100-SXM2-16GB", "count": 1}]},
        ],
    }


def test_a_device_described_by_nameplate_gets_a_modelled_profile(catalogue: Catalogue, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(nameplate_inventory()))
    inventory = load_inventory(path, catalogue)
    device = inventory.devices[0]
    assert (device.model, device.memory_gb, device.peak_tflops, device.peak_power_w) == ("Acme-X1", 32.0, 200.0, 300.0)
    profile = inventory.catalogue(catalogue).profile("Acme-X1")
    assert profile.modelled
    assert profile.from_nameplate
    write_inventory(path, inventory)
    assert load_inventory(path, catalogue) == inventory


def test_a_nameplate_that_shadows_a_catalogue_model_is_refused(catalogue: Catalogue) -> None:
    document = nameplate_inventory()
    document["nameplates"] = {"T4": NAMEPLATE}
    with pytest.raises(ValueError, match="'T4' is in the catalogue"):
        inventory_from_document(document, catalogue)
    document["nameplates"] = {}
    with pytest.raises(KeyError, match="Acme-X1"):
        inventory_from_document(document, catalogue)
