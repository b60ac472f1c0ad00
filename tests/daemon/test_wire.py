"""The wire decoder of device metrics against the protobuf parser it stands in for.

Property: for any batch of values, every value ``decode_metrics`` marks ``ok`` is one that
``hlb.daemon.bus.codec.decode`` reads too, and its reports are exactly protobuf's (bit for bit); every
value protobuf refuses is not ``ok``. And it does read the plain metrics values agents send.
"""

from __future__ import annotations

import struct
import threading
from typing import Any
from unittest import mock

import numpy as np
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hlb.daemon.ingest.pipeline
from hlb.daemon.bus.codec import decode
from hlb.daemon.bus.seam import MemoryBus, RawEvent
from hlb.daemon.bus.wire import IdIndex, MetricsColumns, decode_metrics
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.errors import EventError
from hlb.daemon.ingest.pipeline import Ingestor
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev

MAX_BYTES = 1 << 20

ascii_text = st.text(st.characters(codec="ascii"), max_size=12)
any_text = st.text(max_size=12)
doubles = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 5e-324, 1.0, 0.5])
healths = st.integers(0, 3) | st.integers(-(2**31), 2**31 - 1)
times = st.integers(0, 2**41) | st.integers(-(2**63), 2**63 - 1)


@st.composite
def device_metrics(draw: st.DrawFn, ids: st.SearchStrategy[str]) -> ev.DeviceMetrics:
    return ev.DeviceMetrics(
        device_id=draw(ids),
        utilization=draw(doubles),
        memory_used_gb=draw(doubles),
        power_w=draw(doubles),
        temperature_c=draw(doubles),
        health=draw(healths),  # type: ignore[arg-type]
    )


@st.composite
def metrics_events(draw: st.DrawFn, text: st.SearchStrategy[str] = any_text) -> ev.TelemetryEvent:
    ids = st.sampled_from(["d0", "d1", "gpu-7", ""]) | text
    event = ev.TelemetryEvent(cell=draw(text), event_time_ms=draw(times), source=draw(text))
    if draw(st.booleans()):
        event.device_metrics.CopyFrom(draw(device_metrics(ids)))
    else:
        event.metrics_batch.devices.extend(draw(st.lists(device_metrics(ids), max_size=6)))
        if draw(st.integers(0, 5)) == 0:
            event.metrics_batch.links.add(link_id="l", utilization=0.5)
    return event


other_events = st.sampled_from(
    [
        ev.TelemetryEvent(cell="c", device_upsert=ev.Device(id="d0", host_id="h")),
        ev.TelemetryEvent(cell="c", link_metrics=ev.LinkMetrics(link_id="l", utilization=0.1)),
        ev.TelemetryEvent(cell="c"),
    ]
)


@st.composite
def mutated(draw: st.DrawFn, value: bytes) -> bytes:
    """``value`` changed the ways bytes on a bus go wrong: cut, flipped, spliced, duplicated."""
    data = bytearray(value)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["cut", "flip", "insert", "delete", "repeat"]))
        if kind == "cut":
            del data[at:]
        elif kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        elif kind == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 12))]
    return bytes(data)


@st.composite
def values(draw: st.DrawFn) -> bytes:
    event = draw(metrics_events() | other_events)
    value = event.SerializeToString()
    form = draw(st.sampled_from(["plain", "plain", "mutated", "concatenated", "json", "junk"]))
    if form == "mutated":
        return draw(mutated(value))
    if form == "concatenated":  # valid protobuf (a merge), but not a shape the fast path reads
        return value + draw(metrics_events()).SerializeToString()
    if form == "json":
        return draw(st.sampled_from([b"", b" ", b"\n"])) + json_format.MessageToJson(event).encode()
    if form == "junk":
        return draw(st.binary(max_size=40))
    return value


def double_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same_as_protobuf(columns: MetricsColumns, i: int, value: bytes, max_bytes: int) -> None:
    try:
        event = decode(value, ev.TelemetryEvent, max_bytes)
    except EventError:
        assert not columns.ok[i], f"value {i} is refused by protobuf but was read: {value!r}"
        return
    if not columns.ok[i]:
        return  # left to protobuf: always allowed
    kind = event.WhichOneof("payload")
    assert kind in ("device_metrics", "metrics_batch")
    reports = [event.device_metrics] if kind == "device_metrics" else list(event.metrics_batch.devices)
    assert not event.metrics_batch.links
    assert columns.event_time_ms[i] == event.event_time_ms
    first, count = int(columns.first[i]), int(columns.count[i])
    assert count == len(reports)
    ids = columns.device_ids(first, first + count)
    for k, report in enumerate(reports):
        r = first + k
        assert ids[k] == report.device_id.encode()
        for name in ("utilization", "memory_used_gb", "power_w", "temperature_c"):
            assert double_bits(getattr(columns, name)[r]) == double_bits(getattr(report, name)), name
        assert columns.health[r] == report.health


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(values(), min_size=1, max_size=8), st.sampled_from([MAX_BYTES, 64, 200]))
def test_what_the_wire_decoder_reads_is_what_protobuf_reads(batch: list[bytes], max_bytes: int) -> None:
    columns = decode_metrics(batch, max_bytes)
    assert len(columns.ok) == len(batch)
    assert int(columns.count.sum()) == len(columns.utilization)
    for i, value in enumerate(batch):
        assert_same_as_protobuf(columns, i, value, max_bytes)


@settings(max_examples=300, deadline=None)
@given(st.lists(metrics_events(ascii_text), min_size=1, max_size=6))
def test_plain_metrics_values_are_read_by_the_wire_decoder(events: list[ev.TelemetryEvent]) -> None:
    batch = [e.SerializeToString() for e in events]
    columns = decode_metrics(batch, MAX_BYTES)
    for i, (event, value) in enumerate(zip(events, batch, strict=True)):
        reports = [event.device_metrics] if event.HasField("device_metrics") else event.metrics_batch.devices
        plain = (
            event.event_time_ms >= 0
            and not event.metrics_batch.links
            and all(r.device_id and 0 <= r.health < 128 for r in reports)
            and value.lstrip()[:1] != b"{"
        )
        assert columns.ok[i] == plain, (event, value)
        assert_same_as_protobuf(columns, i, value, MAX_BYTES)


def test_what_it_leaves_to_protobuf() -> None:
    device = ev.DeviceMetrics(device_id="d0", utilization=0.5, health=ev.HEALTH_HEALTHY)
    plain = ev.TelemetryEvent(cell="c", event_time_ms=5, metrics_batch=ev.MetricsBatch(devices=[device]))
    value = plain.SerializeToString()
    unknown_field = value + b"\x28\x01"  # field 5, a varint: not in TelemetryEvent
    reordered = ev.TelemetryEvent(metrics_batch=plain.metrics_batch).SerializeToString() + b"\x0a\x01c"
    non_ascii = ev.TelemetryEvent(cell="zürich", metrics_batch=plain.metrics_batch).SerializeToString()
    bad_utf8 = value.replace(b"d0", b"\xff0")
    too_many = ev.TelemetryEvent(metrics_batch=ev.MetricsBatch(devices=[device] * 513)).SerializeToString()
    batch = [value, unknown_field, reordered, non_ascii, bad_utf8, too_many, value[:-1], b"", value]
    columns = decode_metrics(batch, MAX_BYTES)
    assert columns.ok.tolist() == [True, False, False, False, True, False, False, False, True]
    # Invalid UTF-8 in an id is read as bytes; no known id matches it, so protobuf gets it and refuses it.
    assert IdIndex(["d0"]).rows(columns.buffer, columns.id_start, columns.id_end).tolist() == [0, -1, 0]


id_texts = st.text(max_size=80) | st.sampled_from(["d0", "d1", "a" * 64, "a" * 65, "é" * 40, "\x00", "d0\x00"])


@settings(max_examples=200, deadline=None)
@given(st.lists(id_texts | st.none(), max_size=30), st.lists(id_texts, max_size=30))
def test_the_id_index_finds_exactly_the_known_ids(table: list[str | None], asked: list[str]) -> None:
    table = [None if i in table[:row] else i for row, i in enumerate(table)]  # a table holds an id once
    known = {i: row for row, i in enumerate(table) if i is not None}
    words = [a.encode() for a in asked]
    buffer = b"".join(words) + bytes(80)
    lengths = np.array([len(w) for w in words], dtype=np.int64)
    end = np.cumsum(lengths)
    rows = IdIndex(table).rows(buffer, end - lengths, end)
    assert rows.tolist() == [known.get(a, -1) for a in asked]


# -- ingest: the fast path changes nothing but speed ----------------------------------------------

TOPICS = Topics()


def run_ingest(records: list[bytes], fast: bool) -> tuple[Any, ...]:
    bus = MemoryBus()
    graph = InfraGraph()
    scheduler = Scheduler(graph, LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)
    ingestor = Ingestor(bus.source([TOPICS.telemetry], "g"), bus, scheduler, threading.RLock(), TOPICS, 4096)
    batch = [RawEvent(TOPICS.telemetry, 0, i, b"c", v) for i, v in enumerate(records)]
    real = decode_metrics

    def nothing_read(values: list[bytes], max_bytes: int) -> MetricsColumns:
        columns = real(values, max_bytes)
        columns.ok[:] = False  # every value to protobuf, as before the wire decoder
        return columns

    with mock.patch.object(hlb.daemon.ingest.pipeline, "decode_metrics", real if fast else nothing_read):
        ingestor.apply_batch(batch)
    d = graph.devices
    headers = [dict(r.headers) for r in bus.read_all(TOPICS.dlq)]
    dead = [(h["hlb.source.offset"], h["hlb.error.message"]) for h in headers]
    columns = (d.utilization, d.memory_used_gb, d.power_w, d.temperature_c, d.health, d.metrics_ms)
    return (
        [c.tobytes() for c in columns],
        graph.newest_telemetry_ms,
        ingestor.stats.applied,
        dict(ingestor.stats.rejected),
        ingestor.stats.metrics_reports,
        dead,
    )


def inventory(device_id: str) -> bytes:
    device = ev.Device(id=device_id, host_id="h", kind=ev.DEVICE_KIND_GPU, memory_gb=16)
    return ev.TelemetryEvent(cell="c", device_upsert=device).SerializeToString()


small_doubles = st.sampled_from([0.0, 0.25, 1.0, 2.0, 20.0, -1.0, float("nan")])


@st.composite
def ingest_records(draw: st.DrawFn) -> list[bytes]:
    records = [inventory("d0"), inventory("d1")]
    for _ in range(draw(st.integers(1, 25))):
        choice = draw(st.integers(0, 9))
        if choice == 0:
            records.append(inventory(draw(st.sampled_from(["d2", "d3"]))))
            continue
        reports = [
            ev.DeviceMetrics(
                device_id=draw(st.sampled_from(["d0", "d1", "d2", "d3", "nope"])),
                utilization=draw(small_doubles),
                memory_used_gb=draw(small_doubles),
                power_w=draw(small_doubles),
                health=draw(st.integers(0, 4)),  # type: ignore[arg-type]
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        event = ev.TelemetryEvent(cell="c", event_time_ms=draw(st.integers(0, 3000)))
        event.metrics_batch.devices.extend(reports)
        value = event.SerializeToString()
        records.append(draw(mutated(value)) if choice == 1 else value)
    return records


@settings(max_examples=150, deadline=None)
@given(ingest_records())
def test_ingest_with_the_wire_decoder_ends_as_ingest_through_protobuf(records: list[bytes]) -> None:
    assert run_ingest(records, fast=True) == run_ingest(records, fast=False)
