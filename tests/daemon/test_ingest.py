"""Ingest over the in-memory bus: decode (protobuf or JSON), apply, dead-letter, commit after apply."""

from __future__ import annotations

import threading

from daemon.bus import MemoryBus
from daemon.config import Topics
from daemon.graph import InfraGraph
from daemon.ingest import Ingestor, drain
from daemon.ledger import PlacementLedger
from daemon.policy import LeastLoaded
from daemon.scheduler import Scheduler
from hlb.v1 import events_pb2 as ev

TOPICS = Topics()


def make_ingestor(bus: MemoryBus, max_event_bytes: int = 4096) -> Ingestor:
    scheduler = Scheduler(InfraGraph(max_tasks_per_device=0), LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)
    source = bus.source([TOPICS.telemetry, TOPICS.tasks], "g")
    return Ingestor(source, bus, scheduler, threading.RLock(), TOPICS, max_event_bytes)


def publish(bus: MemoryBus, topic: str, value: bytes) -> None:
    bus.publish(topic, b"c", value)


DEVICE = ev.TelemetryEvent(
    cell="c", device_upsert=ev.Device(id="d0", host_id="h0", kind=ev.DEVICE_KIND_GPU, memory_gb=16)
).SerializeToString()


def test_valid_events_are_applied_and_bad_ones_dead_lettered_with_provenance() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    publish(bus, TOPICS.telemetry, DEVICE)
    publish(bus, TOPICS.telemetry, b"\x08\x96\x01garbage\xff")  # neither protobuf of this type nor JSON
    publish(bus, TOPICS.tasks, b'{"submitted": {"id": "json-task", "memory_per_device_gb": 4}}')
    publish(bus, TOPICS.tasks, b'{"submitted": {"id": 12')  # truncated JSON
    publish(bus, TOPICS.tasks, b"x" * 5000)  # oversized
    publish(bus, TOPICS.tasks, ev.TaskEvent(submitted=ev.TaskSpec(id="bin-task")).SerializeToString())

    assert drain(ingestor) == 6
    assert ingestor.stats.applied == 3
    assert dict(ingestor.stats.rejected) == {"decode": 2, "oversized": 1}
    assert {p.task_id for p in ingestor.scheduler.ledger.since(1)} == {"json-task", "bin-task"}

    dead = bus.read_all(TOPICS.dlq)
    assert [dict(r.headers)["hlb.error.reason"] for r in dead] == [b"decode", b"decode", b"oversized"]
    first = dict(dead[0].headers)
    assert first["hlb.source.topic"] == TOPICS.telemetry.encode()
    assert first["hlb.source.offset"] == b"1"
    assert dead[0].value == b"\x08\x96\x01garbage\xff"  # the original bytes, kept for replay


def test_offsets_are_committed_only_after_the_batch_is_applied() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    publish(bus, TOPICS.telemetry, DEVICE)
    publish(bus, TOPICS.tasks, ev.TaskEvent(submitted=ev.TaskSpec(id="t")).SerializeToString())
    assert bus.committed("g", TOPICS.tasks) == 0
    assert ingestor.run_once(100, 0.0) == 2
    assert bus.committed("g", TOPICS.telemetry) == 1
    assert bus.committed("g", TOPICS.tasks) == 1


def test_a_new_consumer_of_the_same_group_resumes_after_the_committed_offsets() -> None:
    bus = MemoryBus()
    publish(bus, TOPICS.telemetry, DEVICE)
    drain(make_ingestor(bus))
    publish(bus, TOPICS.tasks, ev.TaskEvent(submitted=ev.TaskSpec(id="later")).SerializeToString())
    second = make_ingestor(bus)
    assert drain(second) == 1
