"""Poison records through the real broker: a record bigger than librdkafka's default producer limit,
a task whose job_id is a megabyte, telemetry dated the year 3000. None stops ingest or pins a
metric, each is in the DLQ with its reason (cut to ``kafka.dead_letter_max_bytes`` with its
provenance when too big to copy whole), the valid task after them is placed, and a restart that
replays them all serves again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from confluent_kafka import Producer

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.integration.load import CELL, DEVICES, DaemonConfig, Load, assert_exactly_once, fresh_topics, wait_until
from tests.integration.test_faults_malformed import DeadLetters

pytestmark = pytest.mark.kafka

YEAR_3000_MS = 32_503_680_000_000
GARBAGE = b"\xff" * 1_020_000  # not protobuf (field 31, wire type 7), not JSON; librdkafka's default limit is 1,000,000


def poison_records() -> list[tuple[str, bytes]]:
    """(topic name, value): the garbage, a megabyte job_id, a metrics report from the future."""
    huge_job = ev.TaskSpec(id="huge-job", job_id="j" * 1_000_100, memory_per_device_gb=1)
    report = ev.DeviceMetrics(device_id=DEVICES[0].id, utilization=0.5, health=ev.HEALTH_HEALTHY)
    future = ev.TelemetryEvent(cell=CELL, event_time_ms=YEAR_3000_MS, device_metrics=report)
    return [
        ("tasks", GARBAGE),
        ("tasks", ev.TaskEvent(cell=CELL, submitted=huge_job).SerializeToString()),
        ("telemetry", future.SerializeToString()),
    ]


def placement(target: str, task_id: str) -> api.GetPlacementResponse:
    with grpc.insecure_channel(target) as channel:
        reply: api.GetPlacementResponse = api_grpc.SchedulerStub(channel).GetPlacement(
            api.GetPlacementRequest(task_id=task_id), timeout=10.0
        )
        return reply


def is_placed(target: str, task_id: str) -> bool:
    try:
        return placement(target, task_id).HasField("placement")
    except grpc.RpcError:
        return False


def test_poison_records_never_stop_ingest_nor_pin_staleness_and_a_restart_replays_past_them(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    topics = fresh_topics()
    names = {"tasks": topics.tasks, "telemetry": topics.telemetry}
    config = DaemonConfig(tmp_path, kafka_bootstrap, topics)  # kafka.max_event_bytes: the default, 1 MiB
    daemon = config.start()
    load = Load(kafka_bootstrap, topics)
    dead = DeadLetters(kafka_bootstrap, topics.dlq)
    # A producer that may send what the daemon accepts (librdkafka's default limit is below it).
    big = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 2_000_000})
    try:
        load.inventory()
        load.flush()
        wait_until(lambda: daemon.cluster_state().devices == len(DEVICES), 30, "the inventory to be applied")
        load.metrics()
        load.flush()
        for topic, value in poison_records():
            big.produce(names[topic], value=value, key=CELL.encode())
            assert big.flush(30) == 0
        load.submit(ev.TaskSpec(id="after-poison", memory_per_device_gb=1))
        load.flush()

        wait_until(
            lambda: not daemon.alive() or is_placed(daemon.target, "after-poison"),
            60,
            "the task after the poison to be placed",
        )
        assert daemon.alive(), f"hlb serve stopped on a poison record:\n{daemon.log()[-5000:]}"
        wait_until(lambda: dead.poll() >= 3, 60, "three dead letters")
        # The newest telemetry is the valid batch's: staleness grows as time passes.
        wait_until(lambda: daemon.cluster_state().staleness_ms > 1500, 30, "staleness to grow past 1.5 s")
        with pytest.raises(grpc.RpcError) as unknown:
            placement(daemon.target, "huge-job")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        first = placement(daemon.target, "after-poison").placement
        assert daemon.alive(), daemon.log()[-5000:]
        assert daemon.terminate() == 0, daemon.log()[-5000:]

        # Without a snapshot the restart replays the inputs from their start, poison included.
        shutil.rmtree(config.state_dir / "snapshots")
        again = config.start()  # returns once SERVING: the replay went past the poison records
        assert placement(again.target, "after-poison").placement == first
        wait_until(lambda: dead.poll() >= 6, 60, "the replayed records' dead letters")
        state = again.dump()
        assert again.terminate() == 0, again.log()[-5000:]
        records = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap)).read_all(topics.placements)
    finally:
        dead.close()
        config.stop_all()

    assert_exactly_once([ev.Placement.FromString(r.value or b"") for r in records], ["after-poison"])
    assert state["ingest"]["rejected"] == {"decode": 1, "too_large": 1, "clock_skew": 1}
    assert state["newest_telemetry_ms"] < YEAR_3000_MS
    check_dead_letters(dead.records[:3], topics.tasks, topics.telemetry)


def check_dead_letters(records: list[tuple[bytes, dict[str, str]]], tasks: str, telemetry: str) -> None:
    """One dead letter per poison record with its reason; the two too big to copy whole are cut."""
    by_reason = {headers["hlb.error.reason"]: (value, headers) for value, headers in records}
    assert set(by_reason) == {"decode", "too_large", "clock_skew"}
    value, headers = by_reason["decode"]
    assert value == GARBAGE[:1_000_000]  # cut to kafka.dead_letter_max_bytes
    assert (headers["hlb.dlq.truncated"], headers["hlb.source.size"]) == ("value", "1020000")
    assert (headers["hlb.source.topic"], headers["hlb.source.offset"]) == (tasks, "0")
    value, headers = by_reason["too_large"]
    assert headers["hlb.error.message"] == "submitted.job_id: 1000100 bytes, at most 1024 (limits.text_bytes)"
    assert headers["hlb.dlq.truncated"] == "value"
    value, headers = by_reason["clock_skew"]
    assert "hlb.dlq.truncated" not in headers
    assert headers["hlb.source.topic"] == telemetry
    assert ev.TelemetryEvent.FromString(value).event_time_ms == YEAR_3000_MS
