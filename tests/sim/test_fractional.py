"""Shares and partitions in the simulator's inputs and executor (docs/fractional.md): the
inventory and trace formats carry them, and a task that asks for a share runs at its share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hlb.sim.catalogue import Catalogue
from hlb.sim.simulator import simulate
from hlb.sim.topology import inventory_from_document, inventory_to_document, load_inventory, write_inventory
from hlb.sim.traces import TraceError, read_trace, write_trace
from hlb.v1 import events_pb2 as ev
from tests.sim.builders import EXACT, V100, task

A100 = "A100-SXM4-80GB"


def document(devices: list[dict[str, Any]]) -> dict[str, Any]:
    uplink = {"kind": "ethernet", "bandwidth_gbps": 100, "latency_us": 5}
    return {
        "format": "hlb-inventory/1",
        "switches": [{"id": "rack"}],
        "hosts": [{"id": "h0", "rack": "rack", "uplink": uplink, "devices": devices}],
    }


SHARED_AND_PARTITIONED: list[dict[str, Any]] = [
    {"model": V100, "count": 1, "sharing": "mps"},
    {
        "id": "big",
        "model": A100,
        "partitions": [{"profile": "3g.40gb", "memory_gb": 40, "compute_share_milli": 428, "count": 2}],
    },
]


def test_an_inventory_declares_shareable_devices_and_partitions_and_round_trips(
    catalogue: Catalogue, tmp_path: Path
) -> None:
    inventory = inventory_from_document(document(SHARED_AND_PARTITIONED), catalogue)
    by_id = {d.id: d for d in inventory.devices}
    assert [d.id for d in inventory.devices] == ["h0/dev0", "big", "big/mig0", "big/mig1"]
    assert by_id["h0/dev0"].sharing == "mps"
    mig = by_id["big/mig1"]
    assert (mig.parent_id, mig.partition_profile, mig.compute_share_milli, mig.memory_gb) == (
        "big",
        "3g.40gb",
        428,
        40.0,
    )
    assert mig.peak_tflops == pytest.approx(by_id["big"].peak_tflops * 0.428)
    assert mig.idle_power_w == 0.0
    write_inventory(tmp_path / "inv.json", inventory)
    assert load_inventory(tmp_path / "inv.json", catalogue) == inventory
    events = {e.device_upsert.id: e.device_upsert for e in inventory.to_events("c") if e.HasField("device_upsert")}
    assert events["h0/dev0"].sharing == ev.DEVICE_SHARING_MPS
    assert (events["big/mig0"].parent_id, events["big/mig0"].compute_share_milli) == ("big", 428)


def test_a_whole_device_inventory_is_written_as_before(catalogue: Catalogue) -> None:
    plain = inventory_from_document(document([{"model": V100, "count": 2}]), catalogue)
    [host] = inventory_to_document(plain)["hosts"]
    assert host["devices"] == [{"id": "h0/dev0", "model": V100}, {"id": "h0/dev1", "model": V100}]


@pytest.mark.parametrize(
    ("devices", "says"),
    [
        ([{"model": V100, "count": 1, "sharing": "vgpu"}], "sharing 'vgpu'"),
        ([{"model": V100, "count": 1, "share_capacity_milli": 500}], "needs sharing"),
        (
            [
                {
                    "model": A100,
                    "count": 1,
                    "sharing": "mps",
                    "partitions": [{"memory_gb": 10, "compute_share_milli": 142, "count": 1}],
                }
            ],
            "exclusive, whole device",
        ),
        (
            [{"model": A100, "count": 1, "partitions": [{"memory_gb": 10, "compute_share_milli": 0, "count": 1}]}],
            "1..1000",
        ),
    ],
)
def test_a_bad_sharing_entry_is_refused_naming_it(
    catalogue: Catalogue, devices: list[dict[str, Any]], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        inventory_from_document(document(devices), catalogue)


def test_a_trace_carries_shares_and_a_whole_device_trace_keeps_its_columns(tmp_path: Path) -> None:
    tasks = [task("a", 600.0, device_share_milli=250), task("b", 600.0)]
    for name in ("t.csv", "t.jsonl"):
        write_trace(tmp_path / name, tasks)
        assert read_trace(tmp_path / name) == tasks
    write_trace(tmp_path / "whole.csv", tasks[1:])
    assert "device_share_milli" not in (tmp_path / "whole.csv").read_text()
    (tmp_path / "bad.jsonl").write_text(
        '{"task_id": "x", "arrival_s": 0, "workload_class": "c", "work_ref_s": 1, "device_share_milli": 250}\n'
    )
    with pytest.raises(TraceError, match="needs memory_per_device_gb > 0"):
        read_trace(tmp_path / "bad.jsonl")


def test_a_share_runs_at_its_share_of_the_device_and_a_partition_at_its_compute_share(catalogue: Catalogue) -> None:
    inventory = inventory_from_document(document(SHARED_AND_PARTITIONED), catalogue)
    quarter = task("quarter", 600.0, device_share_milli=250, allowed_models=(V100,))
    half = task("half", 600.0, device_share_milli=500, allowed_models=(V100,))
    mig = task("mig", 600.0, device_share_milli=400, allowed_models=(A100,))
    whole = task("whole", 600.0, allowed_models=(A100,), arrival_s=10.0)
    result = simulate(catalogue, inventory, [quarter, half, mig, whole], config=EXACT)
    records = {r.task_id: r for r in result.tasks}
    assert all(r.state == "finished" for r in records.values())
    alone_v100 = catalogue.runtime_s(600.0, "resnet18-bs16", V100)
    alone_a100 = catalogue.runtime_s(600.0, "resnet18-bs16", A100)
    assert records["quarter"].device_ids == records["half"].device_ids == ("h0/dev0",)
    assert records["quarter"].finish_s - records["quarter"].start_s == pytest.approx(alone_v100 / 0.25)
    assert records["half"].finish_s - records["half"].start_s == pytest.approx(alone_v100 / 0.5)
    assert records["mig"].device_ids[0].startswith("big/mig")
    assert records["mig"].finish_s - records["mig"].start_s == pytest.approx(alone_a100 / 0.428)
    # The whole A100 waits until its partition is free again.
    assert records["whole"].device_ids == ("big",)
    assert records["whole"].start_s >= records["mig"].finish_s


def test_a_task_is_colocated_when_its_final_attempt_shared_a_device_with_a_running_task(catalogue: Catalogue) -> None:
    inventory = inventory_from_document(document(SHARED_AND_PARTITIONED), catalogue)
    quarter = task("quarter", 600.0, device_share_milli=250, allowed_models=(V100,))
    half = task("half", 60.0, device_share_milli=500, allowed_models=(V100,))
    mig = task("mig", 600.0, device_share_milli=400, allowed_models=(A100,))
    # Arrives once both shares of the V100 are done: the device is its own.
    later = task("later", 600.0, device_share_milli=250, allowed_models=(V100,), arrival_s=1e6)
    result = simulate(catalogue, inventory, [quarter, half, mig, later], config=EXACT)
    records = {r.task_id: r for r in result.tasks}
    assert all(r.state == "finished" for r in records.values())
    assert records["later"].start_s > max(records["quarter"].finish_s, records["half"].finish_s)
    # The quarter ran beside the half for part of its run only; a partition is a device of its own.
    assert records["half"].finish_s < records["quarter"].finish_s
    assert {i: r.colocated for i, r in records.items()} == {
        "quarter": True,
        "half": True,
        "mig": False,
        "later": False,
    }


def test_a_share_is_estimated_on_its_share_as_the_scorer_counts_it(catalogue: Catalogue) -> None:
    inventory = inventory_from_document(document(SHARED_AND_PARTITIONED), catalogue)
    quarter = task("quarter", 600.0, device_share_milli=250, allowed_models=(V100,))
    half = task("half", 600.0, device_share_milli=500, allowed_models=(V100,), arrival_s=5.0)
    mig = task("mig", 600.0, device_share_milli=400, allowed_models=(A100,))
    result = simulate(catalogue, inventory, [quarter, half, mig], "hetero-greedy", config=EXACT)
    records = {r.task_id: r for r in result.tasks}
    # Without interference each runs exactly at its share (the half beside the quarter too): the
    # estimate, on the share, is the run time observed.
    for name in ("quarter", "half", "mig"):
        record = records[name]
        assert record.estimated_s == pytest.approx(record.finish_s - record.start_s, rel=1e-6)
    assert records["quarter"].estimated_s == pytest.approx(catalogue.runtime_s(600.0, "resnet18-bs16", V100) / 0.25)
