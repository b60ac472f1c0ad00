"""The whole path against a real broker: events in through Kafka, placements out over gRPC.

``hlb serve`` runs as a child process, configured by a YAML file and HLB_ variables. The test
publishes a heterogeneous inventory and tasks with a plain confluent-kafka producer, as an agent
would, and reads decisions back over gRPC and from the ledger topic.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from confluent_kafka import Producer

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Topics
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess

pytestmark = pytest.mark.kafka

GPU, TPU = ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for value in values:
        producer.produce(topic, key=b"it", value=value)
    assert producer.flush(15.0) == 0


def task_event(spec: ev.TaskSpec) -> bytes:
    return ev.TaskEvent(cell="it", submitted=spec).SerializeToString()


def wait_placed(stub: api_grpc.SchedulerStub, task_id: str, timeout_s: float = 30.0) -> ev.Placement:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = stub.GetPlacement(api.GetPlacementRequest(task_id=task_id), timeout=5.0)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: not consumed yet
                raise
        else:
            if reply.HasField("placement"):
                return reply.placement
        time.sleep(0.1)
    raise AssertionError(f"task {task_id} not placed within {timeout_s} s")


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


TASKS = [
    # (spec, what it may run on)
    ev.TaskSpec(id="big-llm", num_devices=2, memory_per_device_gb=70, allowed_kinds=[GPU]),  # only A100 80 GB
    ev.TaskSpec(id="tpu-only", num_devices=4, memory_per_device_gb=16, allowed_kinds=[TPU]),
    ev.TaskSpec(id="v100-pinned", memory_per_device_gb=20, allowed_models=["V100-SXM2-32GB"]),
    *[ev.TaskSpec(id=f"small-{i}", memory_per_device_gb=10, allowed_kinds=[GPU]) for i in range(12)],
    *[ev.TaskSpec(id=f"any-{i}", memory_per_device_gb=4) for i in range(6)],
]


def test_tasks_from_kafka_are_placed_feasibly_and_recorded(
    kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    daemon = start_serve()
    inventory = inventory_events("it")
    devices = {e.device_upsert.id: e.device_upsert for e in inventory if e.HasField("device_upsert")}
    produce(kafka_bootstrap, topics.telemetry, [e.SerializeToString() for e in inventory])
    produce(kafka_bootstrap, topics.tasks, [task_event(spec) for spec in TASKS])

    with grpc.insecure_channel(daemon.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        placements = {spec.id: wait_placed(stub, spec.id) for spec in TASKS}
        state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0)

    reserved: dict[str, float] = {}
    for spec in TASKS:
        placement = placements[spec.id]
        assert len(placement.device_ids) == max(1, spec.num_devices)
        assert len(set(placement.device_ids)) == len(placement.device_ids), "a gang member twice on one device"
        for device_id in placement.device_ids:
            device = devices[device_id]
            assert not spec.allowed_kinds or device.kind in spec.allowed_kinds
            assert not spec.allowed_models or device.model in spec.allowed_models
            assert device.memory_gb >= spec.memory_per_device_gb
            reserved[device_id] = reserved.get(device_id, 0.0) + spec.memory_per_device_gb
    assert all(reserved[d] <= devices[d].memory_gb for d in reserved), "a device's memory was overcommitted"
    assert {devices[d].model for d in placements["big-llm"].device_ids} == {"A100-SXM4-80GB"}
    assert state.devices == len(devices)
    assert state.running_tasks == len(TASKS)
    assert state.last_sequence == len(TASKS)

    # The ledger topic holds the same decisions, numbered 1..N without gaps.
    ledger = [ev.Placement.FromString(r.value or b"") for r in KafkaBus(KafkaSettings(
        bootstrap_servers=kafka_bootstrap)).read_all(topics.placements)]  # fmt: skip
    assert sorted(p.sequence for p in ledger) == list(range(1, len(TASKS) + 1))
    assert {p.task_id: list(p.device_ids) for p in ledger} == {k: list(v.device_ids) for k, v in placements.items()}

    assert daemon.terminate() == 0, daemon.log()


def test_malformed_events_go_to_the_dlq_and_the_daemon_keeps_working(
    kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    daemon = start_serve()
    inventory = inventory_events("it")
    produce(kafka_bootstrap, topics.telemetry, [e.SerializeToString() for e in inventory])
    known_device = next(e.device_upsert.id for e in inventory if e.HasField("device_upsert"))
    bad_telemetry = [
        b"\xff\xfe not protobuf at all",
        b'{"cell": "it", "device_metrics": {"device_id": "no-such-device", "utilization": 0.5}}',
        b'{"cell": "it", "device_metrics": {"device_id": "%s", "utilization": 7.5}}' % known_device.encode(),
        b'{"cell": "it", "nonsense_field": 1}',
    ]
    produce(kafka_bootstrap, topics.telemetry, bad_telemetry)
    bad_task = ev.TaskSpec(id="negative", memory_per_device_gb=-1)
    produce(kafka_bootstrap, topics.tasks, [task_event(bad_task), b"", task_event(ev.TaskSpec(id="after-bad"))])
    # JSON (protobuf's JSON mapping) is accepted as well as binary.
    produce(kafka_bootstrap, topics.tasks, [b'{"cell": "it", "submitted": {"id": "from-json", "num_devices": 2}}'])

    with grpc.insecure_channel(daemon.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        assert len(wait_placed(stub, "after-bad").device_ids) == 1
        assert len(wait_placed(stub, "from-json").device_ids) == 2
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetPlacement(api.GetPlacementRequest(task_id="negative"), timeout=5.0)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND

    bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))
    dead: list[dict[str, bytes]] = []
    wait_until(
        lambda: len(dead.__setitem__(slice(None), [dict(r.headers) for r in bus.read_all(topics.dlq)]) or dead) == 6
    )
    reasons = sorted(h["hlb.error.reason"].decode() for h in dead)
    assert reasons == sorted(["decode", "unknown_id", "out_of_range", "decode", "out_of_range", "empty"])
    for headers in dead:
        assert headers["hlb.source.topic"].decode() in (topics.telemetry, topics.tasks)
        assert int(headers["hlb.source.offset"]) >= 0
        assert headers["hlb.error.message"]
    assert daemon.process.poll() is None, "the daemon died on bad input"
    assert daemon.terminate() == 0, daemon.log()


def test_restart_replays_without_placing_anything_twice(
    kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    first = start_serve()
    produce(kafka_bootstrap, topics.telemetry, [e.SerializeToString() for e in inventory_events("it")])
    specs = [ev.TaskSpec(id=f"r-{i}", memory_per_device_gb=8) for i in range(8)]
    produce(kafka_bootstrap, topics.tasks, [task_event(s) for s in specs])
    with grpc.insecure_channel(first.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        before = {s.id: list(wait_placed(stub, s.id).device_ids) for s in specs}
    assert first.terminate() == 0, first.log()

    second = start_serve()
    with grpc.insecure_channel(second.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        # Replay is complete once every task is running again on its recorded devices.
        wait_until(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0).running_tasks == len(specs))
        after = {s.id: list(wait_placed(stub, s.id).device_ids) for s in specs}
        state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0)
    assert after == before
    assert state.last_sequence == len(specs)
    bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))
    assert len(bus.read_all(topics.placements)) == len(specs), "the restart placed a task again"
    assert second.terminate() == 0, second.log()
