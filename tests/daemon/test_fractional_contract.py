"""The fractional contract at ingest (docs/fractional.md): a bad share or a bad shareable or
partitioned device goes to the dead-letter topic with its reason, and the good ones are applied."""

from __future__ import annotations

import threading

import pytest

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.ingest.pipeline import Ingestor, drain
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger

TOPICS = Topics()


def make_ingestor(bus: MemoryBus) -> Ingestor:
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)
    source = bus.source([TOPICS.telemetry, TOPICS.tasks], "g")
    return Ingestor(source, bus, scheduler, threading.RLock(), TOPICS, 4096)


def dead_letters(bus: MemoryBus) -> list[tuple[str, str]]:
    out = []
    for record in bus.read_all(TOPICS.dlq):
        headers = dict(record.headers)
        out.append((headers["hlb.error.reason"].decode(), headers["hlb.error.message"].decode()))
    return out


@pytest.mark.parametrize(
    ("submitted", "reason", "says"),
    [
        (
            '{"id": "t", "device_share_milli": 1001, "memory_per_device_gb": 4}',
            "out_of_range",
            "device_share_milli=1001",
        ),
        ('{"id": "t", "deviceShareMilli": 250}', "inconsistent", "needs memory_per_device_gb > 0"),
        ('{"id": "t", "device_share_milli": -5, "memory_per_device_gb": 4}', "decode", ""),
    ],
)
def test_a_bad_share_is_dead_lettered_with_its_reason_and_nothing_applied(
    submitted: str, reason: str, says: str
) -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    bus.publish(TOPICS.tasks, b"c", f'{{"cell": "c", "submitted": {submitted}}}'.encode())
    bus.publish(
        TOPICS.tasks,
        b"c",
        b'{"cell": "c", "submitted": {"id": "ok", "device_share_milli": 1000, "memory_per_device_gb": 4}}',
    )
    assert drain(ingestor) == 2
    [(got, message)] = dead_letters(bus)
    assert got == reason
    assert says in message
    assert set(ingestor.scheduler.graph.tasks) == {"ok"}  # the good one after it is applied
    assert ingestor.scheduler.graph.tasks["ok"].spec.device_share_milli == 1000


DEVICE = '"host_id": "h0", "kind": "DEVICE_KIND_GPU", "memory_gb": 80'


@pytest.mark.parametrize(
    ("device", "reason", "says"),
    [
        (f'{{"id": "g", {DEVICE}, "sharing": 7}}', "out_of_range", "unknown sharing 7"),
        (
            f'{{"id": "g", {DEVICE}, "sharing": "DEVICE_SHARING_MPS", "share_capacity_milli": 10001}}',
            "out_of_range",
            "share_capacity_milli=10001",
        ),
        (f'{{"id": "g", {DEVICE}, "share_capacity_milli": 500}}', "inconsistent", "without sharing"),
        (f'{{"id": "g", {DEVICE}, "parent_id": "p"}}', "out_of_range", "compute_share_milli=0"),
        (f'{{"id": "g", {DEVICE}, "partition_profile": "1g.10gb"}}', "inconsistent", "names parent_id"),
        (
            f'{{"id": "g", {DEVICE}, "parent_id": "p", "compute_share_milli": 142, "sharing": 1}}',
            "inconsistent",
            "cannot be shareable",
        ),
        (f'{{"id": "g", {DEVICE}, "parent_id": "g", "compute_share_milli": 142}}', "cycle", "its own parent"),
    ],
)
def test_a_bad_shareable_or_partition_device_is_dead_lettered(device: str, reason: str, says: str) -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    bus.publish(TOPICS.telemetry, b"c", f'{{"cell": "c", "device_upsert": {device}}}'.encode())
    assert drain(ingestor) == 1
    [(got, message)] = dead_letters(bus)
    assert got == reason
    assert says in message
    assert len(ingestor.scheduler.graph.devices) == 0
