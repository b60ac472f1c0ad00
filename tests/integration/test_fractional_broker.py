"""Fractional requests end to end through a real broker (docs/fractional.md): a shareable device
and a MIG-partitioned one arrive on the telemetry topic, shares arrive on the tasks topic (JSON
and binary) and over gRPC and ``hlb place``; bad shares go to the dead-letter topic with their
reason; no device ever holds more share or memory than it has; Explain says which share or
partition a task would take, and which devices were refused for share or memory."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import json_format

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Topics
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess
from tests.integration.test_kafka_path import produce, task_event, wait_placed, wait_until

pytestmark = pytest.mark.kafka

INVENTORY = [
    {"host_upsert": {"id": "h0", "cpu_cores": 64, "memory_gb": 512}},
    # Partitions first: the inventory may come in any order.
    *[
        {
            "device_upsert": {
                "id": f"g1-mig{i}", "host_id": "h0", "kind": "DEVICE_KIND_GPU", "model": "A100-SXM4-80GB",
                "memory_gb": 40, "parent_id": "g1", "compute_share_milli": 428, "partition_profile": "3g.40gb",
            }
        }
        for i in range(2)
    ],
    {"device_upsert": {"id": "g0", "host_id": "h0", "kind": "DEVICE_KIND_GPU", "model": "A100-SXM4-80GB",
                       "memory_gb": 80, "sharing": "DEVICE_SHARING_MPS"}},
    {"device_upsert": {"id": "g3", "host_id": "h0", "kind": "DEVICE_KIND_GPU", "model": "A100-SXM4-80GB",
                       "memory_gb": 80, "sharing": "DEVICE_SHARING_TIME_SLICED", "share_capacity_milli": 2000}},
    {"device_upsert": {"id": "g1", "host_id": "h0", "kind": "DEVICE_KIND_GPU", "model": "A100-SXM4-80GB",
                       "memory_gb": 80}},
    {"device_upsert": {"id": "g2", "host_id": "h0", "kind": "DEVICE_KIND_GPU", "model": "V100-SXM2-16GB",
                       "memory_gb": 16}},
]  # fmt: skip
CAPACITY = {"g0": 1000, "g3": 2000, "g1": 1000, "g1-mig0": 428, "g1-mig1": 428, "g2": 1000}
MEMORY = {"g0": 80.0, "g3": 80.0, "g1": 80.0, "g1-mig0": 40.0, "g1-mig1": 40.0, "g2": 16.0}


def hlb_place(target: str, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "hlb.cli", "place", "--target", target, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def _check_capacity(placed: dict[str, ev.Placement], shares: dict[str, int], memory: dict[str, float]) -> None:
    """No device holds more share or memory than it has; shares only on shareable devices or
    partitions, whole tasks never on a partition, a parent and its partitions never at once."""
    held: dict[str, int] = {}
    reserved: dict[str, float] = {}
    for task_id, placement in placed.items():
        assert placement.device_share_milli == shares[task_id]
        assert len(set(placement.device_ids)) == len(placement.device_ids)
        for device_id in placement.device_ids:
            if shares[task_id]:
                assert device_id != "g2", "a share on an exclusive whole device"
                held[device_id] = held.get(device_id, 0) + (
                    CAPACITY[device_id] if "mig" in device_id else shares[task_id]
                )
            else:
                assert "mig" not in device_id, "a whole-device task on a partition"
            reserved[device_id] = reserved.get(device_id, 0.0) + memory[task_id]
    assert len(placed["k-gang"].device_ids) == 2
    assert all(held[d] <= CAPACITY[d] for d in held), held
    assert all(reserved[d] <= MEMORY[d] for d in reserved), reserved
    assert not ({"g1"} & set(reserved) and {"g1-mig0", "g1-mig1"} & set(held)), "a parent and its partition at once"


def test_fractional_requests_are_placed_end_to_end_within_every_devices_share_and_memory(
    kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    daemon = start_serve()
    inventory = [json.dumps({"cell": "it", **event}).encode() for event in INVENTORY]
    produce(kafka_bootstrap, topics.telemetry, inventory)
    # Through Kafka: shares in JSON (both field spellings) and binary, a gang of shares, and two bad ones.
    kafka_tasks = [
        b'{"cell": "it", "submitted": {"id": "k-json", "device_share_milli": 300, "memory_per_device_gb": 10}}',
        b'{"cell": "it", "submitted": {"id": "k-camel", "deviceShareMilli": 300, "memoryPerDeviceGb": 10}}',
        task_event(ev.TaskSpec(id="k-gang", num_devices=2, device_share_milli=400, memory_per_device_gb=20)),
        b'{"cell": "it", "submitted": {"id": "k-too-big", "device_share_milli": 1001, "memory_per_device_gb": 1}}',
        b'{"cell": "it", "submitted": {"id": "k-no-memory", "device_share_milli": 100}}',
        task_event(ev.TaskSpec(id="k-after", device_share_milli=100, memory_per_device_gb=5)),
    ]
    produce(kafka_bootstrap, topics.tasks, kafka_tasks)

    with grpc.insecure_channel(daemon.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        placed = {t: wait_placed(stub, t) for t in ("k-json", "k-camel", "k-gang", "k-after")}
        # Over gRPC: a share placed now, and a whole-device task.
        reply = stub.Place(
            api.PlaceRequest(task=ev.TaskSpec(id="g-share", device_share_milli=250, memory_per_device_gb=8)),
            timeout=10.0,
        )
        assert reply.HasField("placement")
        placed["g-share"] = reply.placement
        whole = stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="g-whole", memory_per_device_gb=8)), timeout=10.0)
        assert whole.HasField("placement")
        placed["g-whole"] = whole.placement
        # Explain a share larger than any partition and than what is free on the shared device.
        why = stub.Explain(
            api.ExplainRequest(task=ev.TaskSpec(id="x", device_share_milli=500, memory_per_device_gb=10), top_k=5),
            timeout=10.0,
        )

    # Through hlb place: a share placed, then explained in words.
    cli = hlb_place(daemon.target, "--json", "--id", "cli-share", "--share-milli", "200", "--memory-gb", "6")
    assert cli.returncode == 0, cli.stderr
    placed["cli-share"] = json_format.Parse(cli.stdout, ev.Placement())
    assert placed["cli-share"].device_share_milli == 200
    explained = hlb_place(daemon.target, "--explain", "--id", "cli-x", "--share-milli", "100", "--memory-gb", "1")
    assert explained.returncode == 0, explained.stderr
    assert "SHARE" in explained.stdout
    assert "PARTITION" in explained.stdout
    refused = hlb_place(daemon.target, "--share-milli", "1001", "--memory-gb", "1")
    assert refused.returncode == 2
    assert "from 0 to 1000" in refused.stderr

    shares = {
        "k-json": 300, "k-camel": 300, "k-gang": 400, "k-after": 100, "g-share": 250, "g-whole": 0, "cli-share": 200,
    }  # fmt: skip
    memory: dict[str, float] = {
        "k-json": 10,
        "k-camel": 10,
        "k-gang": 20,
        "k-after": 5,
        "g-share": 8,
        "g-whole": 8,
        "cli-share": 6,
    }
    _check_capacity(placed, shares, memory)

    # Explain: the shared device's free share and the partitions' size refuse the 500.
    constraints = {e.device_id: e.reason for e in why.excluded}
    assert constraints["g2"].startswith("share: exclusive device")
    candidates = {c.device_id: c for c in why.candidates}
    if "g0" in candidates:  # room left on the shared device: it says what the 500 would take there
        assert candidates["g0"].share_milli == 500
        assert candidates["g0"].free_share_milli >= 500
    else:
        assert constraints["g0"].startswith("share:") or constraints["g0"].startswith("memory:")
    assert all(constraints[d].startswith("share: partition 3g.40gb of g1") for d in ("g1-mig0", "g1-mig1")), constraints

    bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))
    dead: list[dict[str, bytes]] = []
    wait_until(
        lambda: len(dead.__setitem__(slice(None), [dict(r.headers) for r in bus.read_all(topics.dlq)]) or dead) == 2
    )
    assert sorted(h["hlb.error.reason"].decode() for h in dead) == ["inconsistent", "out_of_range"]
    ledger = [ev.Placement.FromString(r.value or b"") for r in bus.read_all(topics.placements)]
    assert {p.task_id: p.device_share_milli for p in ledger} == shares
    assert daemon.terminate() == 0, daemon.log()
