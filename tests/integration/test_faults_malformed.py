"""Malformed input mixed into valid traffic, through the real broker: at least 10,000 bad
messages of every kind; the daemon never stops, each bad one lands in the DLQ once with a reason,
each valid one is applied.

Every bad message is bad by construction, never by chance: a truncation cuts inside the last
field, a wire-type error hides the payload, random and bit-flipped bytes are kept only when
protobuf itself cannot read a payload out of them, and the rest break one stated rule (a range,
an unknown id, a cycle, a duplicate id with another spec, the size limit, the text encoding).
Generation is seeded. ``HLB_FAULTS_LONG=1`` sends ten times as many.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from google.protobuf import json_format

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings
from hlb.v1 import events_pb2 as ev
from tests.integration.load import (
    CELL,
    DEVICES,
    HOSTS,
    INVENTORY,
    DaemonConfig,
    Load,
    assert_exactly_once,
    fresh_topics,
    wait_until,
)

pytestmark = pytest.mark.kafka

LONG = os.environ.get("HLB_FAULTS_LONG") == "1"
BAD = 100_000 if LONG else 10_000
VALID_TASKS = 120
MAX_EVENT_BYTES = 4096
SEED = 3

Rng = np.random.Generator
# A bad message: (topic name "tasks" | "telemetry", value or None, the DLQ reasons it may get)
Bad = tuple[str, bytes | None, frozenset[str]]


def _reasons(*names: str) -> frozenset[str]:
    return frozenset(names)


def task_bytes(spec: ev.TaskSpec) -> bytes:
    return ev.TaskEvent(cell=CELL, event_time_ms=1, source="fuzz", submitted=spec).SerializeToString()


def telemetry_bytes(**payload: object) -> bytes:
    return ev.TelemetryEvent(cell=CELL, event_time_ms=1, source="fuzz", **payload).SerializeToString()  # type: ignore[arg-type]


def has_payload(value: bytes, topic: str) -> bool:
    """Whether protobuf reads a payload out of ``value`` (then it is not bad by construction)."""
    message = ev.TaskEvent() if topic == "tasks" else ev.TelemetryEvent()
    if value.lstrip()[:1] == b"{":
        return True  # the daemon reads these as JSON; random text is not used as a bad sample
    try:
        message.ParseFromString(value)
    except Exception:
        return False
    return message.WhichOneof("payload") is not None


class BadMessages:
    """Seeded generator of bad messages; each kind is one method."""

    def __init__(self, rng: Rng, valid: list[ev.TaskSpec]) -> None:
        self.rng = rng
        self.valid = valid
        self.n = 0

    def _id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}-{self.n}"

    def _spec(self, **fields: object) -> ev.TaskSpec:
        return ev.TaskSpec(id=self._id("bad"), memory_per_device_gb=1, **fields)  # type: ignore[arg-type]

    def truncated(self) -> Bad:
        spec = self.rng.choice(self.valid)  # type: ignore[arg-type]
        whole = task_bytes(spec)
        head = len(ev.TaskEvent(cell=CELL, event_time_ms=1, source="fuzz").SerializeToString())
        cut = int(self.rng.integers(head + 1, len(whole)))  # strictly inside the submitted field
        return "tasks", whole[:cut], _reasons("decode")

    def wrong_wire_type(self) -> Bad:
        # Field 10 (submitted) as a varint: protobuf skips it as unknown and no payload is left.
        value = (
            ev.TaskEvent(cell=CELL).SerializeToString() + bytes([10 << 3 | 0]) + bytes([int(self.rng.integers(128))])
        )
        return "tasks", value, _reasons("empty")

    def random_bytes(self) -> Bad:
        topic = "tasks" if self.rng.random() < 0.5 else "telemetry"
        while True:
            value = self.rng.bytes(int(self.rng.integers(1, 200)))
            if not has_payload(value, topic):
                return topic, value, _reasons("decode", "empty")

    def bit_flipped(self) -> Bad:
        while True:
            value = bytearray(task_bytes(self.rng.choice(self.valid)))  # type: ignore[arg-type]
            for _ in range(int(self.rng.integers(1, 4))):
                value[int(self.rng.integers(len(value)))] ^= 1 << int(self.rng.integers(8))
            if not has_payload(bytes(value), "tasks"):
                return "tasks", bytes(value), _reasons("decode", "empty")

    def empty(self) -> Bad:
        return (
            ("tasks" if self.rng.random() < 0.5 else "telemetry"),
            (b"" if self.rng.random() < 0.5 else None),
            (_reasons("empty")),
        )

    def huge_values(self) -> Bad:
        field, value = [
            ("memory_per_device_gb", 1e308),
            ("memory_per_device_gb", float("inf")),
            ("memory_per_device_gb", float("nan")),
            ("work_ref_s", 1e300),
            ("num_devices", 2**32 - 1),
            ("latency_slo_ms", -1.0),
            ("kind", int(self.rng.integers(4, 2**31))),  # an open enum: any int32 decodes
        ][int(self.rng.integers(7))]
        spec = self._spec()
        setattr(spec, field, value)
        return "tasks", task_bytes(spec), _reasons("out_of_range")

    def long_id(self) -> Bad:
        return "tasks", task_bytes(ev.TaskSpec(id="x" * int(self.rng.integers(257, 2000)))), _reasons("invalid_id")

    def oversized(self) -> Bad:
        spec = self._spec(labels={"padding": "p" * MAX_EVENT_BYTES})
        return "tasks", task_bytes(spec), _reasons("oversized")

    def bad_metrics(self) -> Bad:
        device = DEVICES[int(self.rng.integers(len(DEVICES)))]
        metrics, reason = [
            (ev.DeviceMetrics(device_id=device.id, utilization=1.5), "out_of_range"),
            (ev.DeviceMetrics(device_id=device.id, memory_used_gb=device.memory_gb * 2), "out_of_range"),
            (ev.DeviceMetrics(device_id=device.id, temperature_c=1e6), "out_of_range"),
            (ev.DeviceMetrics(device_id=device.id, power_w=float("nan")), "out_of_range"),
            (ev.DeviceMetrics(device_id=device.id, health=99), "out_of_range"),  # type: ignore[arg-type]
            (ev.DeviceMetrics(device_id=self._id("ghost-device"), utilization=0.5), "unknown_id"),
        ][int(self.rng.integers(6))]
        if self.rng.random() < 0.5:
            return "telemetry", telemetry_bytes(device_metrics=metrics), _reasons(reason)
        good = ev.DeviceMetrics(device_id=DEVICES[0].id, utilization=0.0)
        batch = ev.MetricsBatch(devices=[good, metrics])  # one bad member spoils the batch
        return "telemetry", telemetry_bytes(metrics_batch=batch), _reasons(reason)

    def bad_inventory(self) -> Bad:
        choice = int(self.rng.integers(5))
        if choice == 0:
            device = ev.Device(id=self._id("dev"), host_id=HOSTS[0], kind=99, memory_gb=16)  # type: ignore[arg-type]
            return "telemetry", telemetry_bytes(device_upsert=device), _reasons("out_of_range")
        if choice == 1:
            device = ev.Device(id=self._id("dev"), host_id=HOSTS[0], kind=ev.DEVICE_KIND_GPU, memory_gb=-16)
            return "telemetry", telemetry_bytes(device_upsert=device), _reasons("out_of_range")
        if choice == 2:
            host = ev.Host(id=self._id("host"), cpu_cores=float("nan"))
            return "telemetry", telemetry_bytes(host_upsert=host), _reasons("out_of_range")
        if choice == 3:  # the top switch under one of its own racks
            switch = ev.Switch(id="spine", parent_id=f"rack-00{int(self.rng.integers(4))}")
            return "telemetry", telemetry_bytes(switch_upsert=switch), _reasons("cycle")
        if self.rng.random() < 0.5:
            kind = int(self.rng.integers(5, 2**31))
            link = ev.Link(id=self._id("link"), src_id=DEVICES[0].id, dst_id=DEVICES[1].id, kind=kind)  # type: ignore[arg-type]
            return "telemetry", telemetry_bytes(link_upsert=link), _reasons("out_of_range")
        link = ev.Link(id=self._id("link"), src_id=DEVICES[0].id, dst_id=self._id("nowhere"), bandwidth_gbps=10)
        return "telemetry", telemetry_bytes(link_upsert=link), _reasons("unknown_id")

    def unknown_task(self) -> Bad:
        ghost = self._id("ghost-task")
        event = [
            ev.TaskEvent(finished=ev.TaskFinished(task_id=ghost)),
            ev.TaskEvent(started=ev.TaskStarted(task_id=ghost)),
            ev.TaskEvent(cancelled=ev.EntityRef(id=ghost)),
            ev.TaskEvent(failed=ev.TaskFailed(task_id=ghost, reason="x")),
        ][int(self.rng.integers(4))]
        return "tasks", event.SerializeToString(), _reasons("unknown_id")

    def self_cycle(self) -> Bad:
        task_id = self._id("loop")
        spec = ev.TaskSpec(id=task_id, dependencies=[ev.Dependency(task_id=task_id, transfer_gb=1)])
        return "tasks", task_bytes(spec), _reasons("cycle")

    def duplicate(self) -> Bad:
        original = self.valid[int(self.rng.integers(len(self.valid)))]
        other = ev.TaskSpec()
        other.CopyFrom(original)
        other.memory_per_device_gb = original.memory_per_device_gb + 1 + int(self.rng.integers(4))
        return "tasks", task_bytes(other), _reasons("duplicate_id")

    def bad_json(self) -> Bad:
        texts = [
            '{"cell": "it", "submitted": {"id": 5}}',  # wrong type
            '{"cell": "it", "submitted": {"id": "j", "num_devices": "four"}}',
            '{"cell": "it", "submitted": {"id": "j", "num_devices": -1}}',
            '{"cell": "it", "submitted": {"id": "j", "kind": "NOT_A_KIND"}}',
            '{"cell": "it", "submitted": {"id": "j"',  # cut short
            '{"cell": "it", "no_such_field": {}}',
            '{"cell": "it", "submitted": null}',  # no payload
            "{]",
        ]
        text = texts[int(self.rng.integers(len(texts)))]
        reasons = _reasons("empty") if "null" in text else _reasons("decode")
        return "tasks", text.encode(), reasons

    def wrong_encoding(self) -> Bad:
        text = json.dumps({"cell": "caf\u00e9", "submitted": {"id": self._id("enc")}}, ensure_ascii=False)
        if self.rng.random() < 0.5:
            return "tasks", text.encode("latin-1"), _reasons("decode")  # é is not UTF-8
        return "tasks", text.encode("utf-16"), _reasons("decode")  # a BOM, then two bytes per character

    def kinds(self) -> list[Callable[[], Bad]]:
        return [
            self.truncated, self.wrong_wire_type, self.random_bytes, self.bit_flipped, self.empty,
            self.huge_values, self.long_id, self.oversized, self.bad_metrics, self.bad_inventory,
            self.unknown_task, self.self_cycle, self.duplicate, self.bad_json, self.wrong_encoding,
        ]  # fmt: skip


def valid_tasks(count: int) -> list[ev.TaskSpec]:
    kinds = [[], [ev.DEVICE_KIND_GPU], [ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU]]
    return [
        ev.TaskSpec(id=f"ok-{i:04d}", num_devices=1 + i % 2, memory_per_device_gb=1, allowed_kinds=kinds[i % 3])
        for i in range(count)
    ]


@dataclass
class Traffic:
    """What the test publishes, in order: ("metrics", None) marks a valid metrics batch."""

    sends: list[tuple[str, bytes | None]]
    bad: list[Bad]
    valid_events: int  # valid task events among ``sends`` (metrics batches are counted apart)
    placeable: list[ev.TaskSpec]
    waiting: list[ev.TaskSpec]


def plan_traffic(rng: Rng) -> Traffic:
    """Valid submissions (a fifth as JSON), tasks that wait forever, metrics, and the bad messages.

    A duplicate or a cycle-closing task is bad only after the task it collides with, so those
    come after every valid submission; the other bad messages are spread over the whole stream.
    """
    placeable = valid_tasks(VALID_TASKS)
    # Valid tasks that wait for a task that never comes; bad ones close the cycle back to them.
    waiting = [ev.TaskSpec(id=f"wait-{i}", dependencies=[ev.Dependency(task_id=f"close-{i}")]) for i in range(20)]
    closing = [ev.TaskSpec(id=f"close-{i}", dependencies=[ev.Dependency(task_id=f"wait-{i}")]) for i in range(20)]
    valid: list[bytes] = [
        json_format.MessageToJson(ev.TaskEvent(cell=CELL, submitted=s)).encode() if i % 5 == 0 else task_bytes(s)
        for i, s in enumerate(placeable)
    ]
    valid += [task_bytes(s) for s in waiting]
    generator = BadMessages(rng, placeable)
    kinds = generator.kinds()
    free = [kind for kind in kinds if kind != generator.duplicate]
    bad = [free[int(rng.integers(len(free)))]() for _ in range(BAD * 9 // 10)]
    late = [generator.duplicate() for _ in range(BAD // 10 - len(closing))]
    late += [("tasks", task_bytes(spec), _reasons("cycle")) for spec in closing]
    head: list[tuple[str, bytes | None]] = [("tasks", v) for v in valid]
    for topic, value, _ in bad[: BAD // 10]:
        head.insert(int(rng.integers(len(head) + 1)), (topic, value))
    tail: list[tuple[str, bytes | None]] = [(topic, value) for topic, value, _ in bad[BAD // 10 :] + late]
    tail = [tail[int(i)] for i in rng.permutation(len(tail))]
    for _ in range(60):
        tail.insert(int(rng.integers(len(tail) + 1)), ("metrics", None))
    return Traffic(head + tail + [("metrics", None)], bad + late, len(valid), placeable, waiting)


def test_malformed_messages_go_to_the_dlq_with_a_reason_and_valid_ones_are_applied(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    traffic = plan_traffic(np.random.default_rng(SEED))
    topics = fresh_topics()
    names = {"tasks": topics.tasks, "telemetry": topics.telemetry}
    config = DaemonConfig(tmp_path, kafka_bootstrap, topics, kafka={"max_event_bytes": MAX_EVENT_BYTES})
    daemon = config.start()
    load = Load(kafka_bootstrap, topics, seed=SEED)
    dead = DeadLetters(kafka_bootstrap, topics.dlq)
    try:
        load.inventory()
        load.flush()  # the bad inventory (a switch cycle) must find the tree in place
        wait_until(lambda: daemon.cluster_state().devices == len(DEVICES), 30, "the inventory to be applied")
        metrics_sent = 0
        for topic, value in traffic.sends:
            if topic == "metrics":
                load.metrics(neutral=True)
                metrics_sent += 1
            else:
                send_raw(load, names[topic], value)
        load.flush()
        wait_until(lambda: dead.poll() >= len(traffic.bad), 120, f"{len(traffic.bad)} dead letters", step_s=0.0)
        state = daemon.dump()
        records = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap)).read_all(topics.placements)
        dead.poll()
        assert daemon.alive(), "the daemon died on bad input"
        assert daemon.terminate() == 0, daemon.log()[-5000:]
    finally:
        dead.close()
        config.stop_all()

    check_dead_letters(dead.records, traffic.bad, {topics.tasks, topics.telemetry})
    # Every valid message was applied: each event counted once, each task placed once or waiting.
    assert state["ingest"]["applied"] == len(INVENTORY) + traffic.valid_events + metrics_sent
    assert sum(state["ingest"]["rejected"].values()) == len(traffic.bad)
    assert_exactly_once([ev.Placement.FromString(r.value or b"") for r in records], [s.id for s in traffic.placeable])
    assert {s.id: state["tasks"][s.id]["state"] for s in traffic.waiting} == dict.fromkeys(
        (s.id for s in traffic.waiting), "pending"
    )
    assert state["newest_telemetry_ms"] == load.last_metrics_ms
    assert len(state["devices"]) == len(DEVICES), "a bad inventory event added or removed a device"
    assert state["switches"]["spine"]["parent"] is None, "a cyclic switch update was applied"


def check_dead_letters(records: list[tuple[bytes, dict[str, str]]], bad: list[Bad], sources: set[str]) -> None:
    """Each bad message is in the DLQ exactly once, with a reason its kind may get and its origin."""
    assert len(records) == len(bad)
    assert Counter(value for value, _ in records) == Counter(value or b"" for _, value, _ in bad)
    allowed: dict[bytes, set[str]] = {}
    for _, value, reasons in bad:
        allowed.setdefault(value or b"", set()).update(reasons)
    wrong = [(v[:40], h["hlb.error.reason"]) for v, h in records if h["hlb.error.reason"] not in allowed[v]]
    assert not wrong, f"{len(wrong)} dead letters with an unexpected reason, e.g. {wrong[:5]}"
    seen = Counter(h["hlb.error.reason"] for _, h in records)
    kinds = {"decode", "empty", "out_of_range", "invalid_id", "oversized", "unknown_id", "cycle", "duplicate_id"}
    assert kinds <= seen.keys(), f"reasons never seen: {kinds - seen.keys()} (seen {seen})"
    for _, headers in records:
        assert headers["hlb.source.topic"] in sources
        assert int(headers["hlb.source.offset"]) >= 0
        assert headers["hlb.error.message"]


def send_raw(load: Load, topic: str, value: bytes | None) -> None:
    """Publish a value as it is (``None`` is a record without a value)."""
    while True:
        try:
            load.producer.produce(topic, value=value, key=CELL.encode())
            break
        except BufferError:
            load.producer.poll(0.05)
    load.producer.poll(0)


class DeadLetters:
    """Reads the DLQ topic from its start: (value, headers as text) per record."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "dlq-reader",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 20,
            }
        )
        self.consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self.records: list[tuple[bytes, dict[str, str]]] = []

    def poll(self) -> int:
        for message in self.consumer.consume(10_000, 0.2):
            if message.error() is None:
                raw = message.headers() or []
                pairs = raw.items() if isinstance(raw, dict) else raw
                headers = {k: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v or "") for k, v in pairs}
                self.records.append((message.value() or b"", headers))
        return len(self.records)

    def close(self) -> None:
        self.consumer.close()
