"""Ingest over the in-memory bus: decode (protobuf or JSON), bound, apply, dead-letter, commit after apply."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from hlb.daemon.bus.kafka import parse_lag
from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import LimitsSettings, Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.ingest.pipeline import Ingestor, drain
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev

TOPICS = Topics()


def make_ingestor(bus: MemoryBus, max_event_bytes: int = 4096, **options: Any) -> Ingestor:
    scheduler = Scheduler(InfraGraph(max_tasks_per_device=0), LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)
    source = bus.source([TOPICS.telemetry, TOPICS.tasks], "g")
    return Ingestor(source, bus, scheduler, threading.RLock(), TOPICS, max_event_bytes, **options)


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


def telemetry(time_ms: int = 1000, **payload: object) -> bytes:
    return ev.TelemetryEvent(cell="c", event_time_ms=time_ms, **payload).SerializeToString()  # type: ignore[arg-type]


def metrics(*reports: tuple[str, float]) -> ev.MetricsBatch:
    return ev.MetricsBatch(devices=[ev.DeviceMetrics(device_id=d, utilization=u) for d, u in reports])


def device(device_id: str) -> ev.Device:
    return ev.Device(id=device_id, host_id="h0", kind=ev.DEVICE_KIND_GPU, memory_gb=16)


def test_a_bad_report_in_a_metrics_run_is_dead_lettered_and_the_rest_applied_in_order() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    publish(bus, TOPICS.telemetry, DEVICE)
    publish(bus, TOPICS.telemetry, telemetry(1000, metrics_batch=metrics(("d0", 0.2))))
    publish(bus, TOPICS.telemetry, telemetry(1100, metrics_batch=metrics(("d0", 0.3), ("d1", 0.5))))  # d1 unknown
    publish(bus, TOPICS.telemetry, telemetry(1200, device_upsert=device("d1")))  # splits the run
    publish(bus, TOPICS.telemetry, telemetry(1300, metrics_batch=metrics(("d1", 0.7), ("d0", 9.0))))  # 9 > 1
    publish(bus, TOPICS.telemetry, telemetry(1400, device_metrics=ev.DeviceMetrics(device_id="d1", utilization=0.6)))
    publish(bus, TOPICS.telemetry, telemetry(1500, metrics_batch=metrics(("d0", 0.4))))
    assert drain(ingestor) == 7

    g = ingestor.scheduler.graph
    assert dict(ingestor.stats.rejected) == {"unknown_id": 1, "out_of_range": 1}
    assert [int(dict(r.headers)["hlb.source.offset"]) for r in bus.read_all(TOPICS.dlq)] == [2, 4]
    assert g.devices.utilization[g.devices.index["d0"]] == 0.4
    assert g.devices.utilization[g.devices.index["d1"]] == 0.6
    assert g.devices.metrics_ms[g.devices.index["d1"]] == 1400
    assert g.newest_telemetry_ms == 1500
    assert ingestor.stats.metrics_reports == 3


def test_a_submission_that_closes_a_dependency_cycle_is_refused() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)

    def task(task_id: str, *deps: str) -> bytes:
        spec = ev.TaskSpec(id=task_id, dependencies=[ev.Dependency(task_id=d) for d in deps])
        return ev.TaskEvent(submitted=spec).SerializeToString()

    publish(bus, TOPICS.tasks, task("a", "c"))  # c is not submitted yet: allowed
    publish(bus, TOPICS.tasks, task("b", "a"))
    publish(bus, TOPICS.tasks, task("c", "b"))  # c -> b -> a -> c
    publish(bus, TOPICS.tasks, task("d", "a", "b"))  # a DAG with shared ancestors is fine
    publish(bus, TOPICS.tasks, task("b", "a"))  # a replay of a known submission
    drain(ingestor)
    assert dict(ingestor.stats.rejected) == {"cycle": 1}
    dead = bus.read_all(TOPICS.dlq)
    assert b"['c', 'b', 'a', 'c']" in dict(dead[0].headers)["hlb.error.message"]
    assert set(ingestor.scheduler.graph.tasks) == {"a", "b", "d"}


def test_applied_inventory_is_mirrored_to_the_compacted_topic_with_tombstones_for_removals() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    publish(bus, TOPICS.telemetry, DEVICE)
    publish(bus, TOPICS.telemetry, telemetry(device_removed=ev.EntityRef(id="d0")))
    publish(bus, TOPICS.telemetry, telemetry(link_upsert=ev.Link(id="l", src_id="nowhere", dst_id="x")))  # refused
    publish(bus, TOPICS.telemetry, telemetry(metrics_batch=metrics()))
    drain(ingestor)
    mirrored = bus.read_all(TOPICS.inventory)
    assert [(r.key, r.value is None) for r in mirrored] == [(b"d0", False), (b"d0", True)]
    assert mirrored[0].value == DEVICE


def test_lag_and_staleness_are_measured() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    ingestor.clock = lambda: 2.0  # 2000 ms
    publish(bus, TOPICS.telemetry, DEVICE)
    for t in (1500, 1900, 1990):
        publish(bus, TOPICS.telemetry, telemetry(t, metrics_batch=metrics(("d0", 0.1))))
    assert ingestor.stats.staleness_p99_ms() == -1.0
    ingestor.run_once(2, 0.0)
    assert ingestor.stats.lag == {(TOPICS.telemetry, 0): 2, (TOPICS.tasks, 0): 0}
    ingestor.run_once(1, 0.0)
    ingestor.run_once(1, 0.0)
    assert list(ingestor.stats.staleness_ms) == [500.0, 100.0, 10.0]
    assert 100.0 < ingestor.stats.staleness_p99_ms() <= 500.0
    assert ingestor.stats.lag[(TOPICS.telemetry, 0)] == 0


def test_peak_staleness_is_the_age_the_graph_had_reached_when_newer_telemetry_arrived() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus)
    now = [2.0]
    ingestor.clock = lambda: now[0]
    publish(bus, TOPICS.telemetry, DEVICE)
    publish(bus, TOPICS.telemetry, telemetry(1500, metrics_batch=metrics(("d0", 0.1))))
    ingestor.run_once(2, 0.0)  # the first telemetry: no earlier age to report
    assert list(ingestor.stats.staleness_peak_ms) == []
    now[0] = 2.3
    publish(bus, TOPICS.telemetry, DEVICE)  # inventory only: the newest telemetry stays as it was
    ingestor.run_once(1, 0.0)
    publish(bus, TOPICS.telemetry, telemetry(2250, metrics_batch=metrics(("d0", 0.2))))
    ingestor.run_once(1, 0.0)
    assert list(ingestor.stats.staleness_peak_ms) == [800.0]  # 2300 - 1500, just before the refresh
    assert list(ingestor.stats.staleness_ms) == [500.0, 800.0, 50.0]
    assert ingestor.stats.staleness_peak_p99_ms() == 800.0


def test_librdkafka_statistics_give_lag_per_assigned_partition() -> None:
    stats = {
        "topics": {
            "hlb.telemetry": {
                "partitions": {
                    "0": {"consumer_lag": 42, "fetch_state": "active"},
                    "1": {"consumer_lag": -1, "fetch_state": "active"},  # not known yet
                    "2": {"consumer_lag": 5, "fetch_state": "none"},  # not assigned
                    "-1": {"consumer_lag": 0},  # librdkafka's internal UA partition
                }
            }
        }
    }
    assert parse_lag(json.dumps(stats)) == {("hlb.telemetry", 0): 42}


# -- poison records: a dead letter that cannot be published never stops ingest --------------------


class RefusingPublisher:
    """A bus whose dead-letter topic refuses records bigger than ``max_bytes`` (as librdkafka
    refuses one over its message.max.bytes, raising at once), or every record (``max_bytes`` -1)."""

    def __init__(self, bus: MemoryBus, max_bytes: int) -> None:
        self.bus = bus
        self.max_bytes = max_bytes
        self.refused = 0

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        if topic == TOPICS.dlq and len(value or b"") > self.max_bytes:
            self.refused += 1
            raise RuntimeError("KafkaError{code=MSG_SIZE_TOO_LARGE}")
        self.bus.publish(topic, key, value, headers)

    def flush(self, timeout_s: float) -> int:
        return 0


def task_event(task_id: str, **spec: Any) -> bytes:
    return ev.TaskEvent(submitted=ev.TaskSpec(id=task_id, **spec)).SerializeToString()


def test_a_dead_letter_too_big_to_publish_goes_as_a_cut_copy_with_its_provenance() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus, max_event_bytes=1 << 20)
    ingestor.publisher = RefusingPublisher(bus, max_bytes=10_000)
    publish(bus, TOPICS.telemetry, DEVICE)
    garbage = b"\xff" * 50_000
    publish(bus, TOPICS.tasks, garbage)
    publish(bus, TOPICS.tasks, task_event("after", memory_per_device_gb=1))
    assert drain(ingestor) == 3
    [dead] = bus.read_all(TOPICS.dlq)
    headers = dict(dead.headers)
    assert headers["hlb.error.reason"] == b"decode"
    assert headers["hlb.dlq.truncated"] == b"value"
    assert headers["hlb.source.size"] == b"50000"
    assert (headers["hlb.source.topic"], headers["hlb.source.offset"]) == (TOPICS.tasks.encode(), b"0")
    assert dead.value == garbage[:1024]
    assert [p.task_id for p in ingestor.scheduler.ledger.since(1)] == ["after"]


def test_a_dead_letter_that_cannot_be_published_is_counted_logged_once_and_never_stops_ingest() -> None:
    bus = MemoryBus()
    now = [100.0]
    ingestor = make_ingestor(bus, monotonic=lambda: now[0])
    ingestor.publisher = RefusingPublisher(bus, max_bytes=-1)
    publish(bus, TOPICS.telemetry, DEVICE)
    for i in range(3):
        publish(bus, TOPICS.tasks, b"\xff" * (100 + i))
    publish(bus, TOPICS.tasks, task_event("valid", memory_per_device_gb=1))
    with capture_logs() as logs:
        assert ingestor.run_once(10, 0.0) == 5
        now[0] += 11.0
        publish(bus, TOPICS.tasks, b"\xff")
        assert ingestor.run_once(10, 0.0) == 1
    assert ingestor.stats.dead_letter_failures == 4
    assert ingestor.stats.rejected == {"decode": 4}
    assert bus.committed("g", TOPICS.tasks) == 5  # past every refused record: none is replayed
    assert [p.task_id for p in ingestor.scheduler.ledger.since(1)] == ["valid"]
    failures = [entry for entry in logs if entry["event"] == "dead letter not published"]
    assert [f["repeats"] for f in failures] == [0, 2]  # the first at once, the next two folded into one line
    assert failures[0]["offset"] == 0


def test_a_dead_letter_keeps_at_most_dead_letter_max_bytes_of_the_record() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus, max_event_bytes=4096, dead_letter_max_bytes=2048)
    publish(bus, TOPICS.tasks, b"x" * 5000)  # oversized
    publish(bus, TOPICS.tasks, b"\xff" * 2048)  # at the limit: copied whole
    drain(ingestor)
    cut, whole = bus.read_all(TOPICS.dlq)
    assert (cut.value, dict(cut.headers)["hlb.dlq.truncated"]) == (b"x" * 2048, b"value")
    assert dict(cut.headers)["hlb.source.size"] == b"5000"
    assert whole.value == b"\xff" * 2048
    assert "hlb.dlq.truncated" not in dict(whole.headers)


# -- bounded input: every string, list and map ------------------------------------------------------


def over_limits() -> list[tuple[str, bytes, str, str]]:
    """(topic, record, reason, what the message names) for one field over each kind of limit."""
    labels = {f"k{i}": "v" for i in range(65)}
    tasks = [
        (task_event("t", job_id="j" * 1_000_100), "too_large", "submitted.job_id: 1000100 bytes, at most 1024"),
        (task_event("t", workload_class="w" * 1025), "too_large", "submitted.workload_class: 1025 bytes"),
        (task_event("t", labels=labels), "too_large", "submitted.labels: 65 entries, at most 64 (limits.labels)"),
        (task_event("t", labels={"k": "\u00e9" * 513}), "too_large", "submitted.labels['k']: 1026 bytes"),
        (task_event("t", labels={"k" * 1025: "v"}), "too_large", f"submitted.labels['{'k' * 40}'] key: 1025 bytes"),
        (task_event("t", allowed_models=["m"] * 4097), "too_large", "submitted.allowed_models: 4097 entries"),
        (task_event("t", preferred_models=["m", "m" * 2000]), "too_large", "submitted.preferred_models[1]: 2000"),
        (task_event("t", allowed_kinds=[1] * 4097), "too_large", "submitted.allowed_kinds: 4097 entries, at most 4096"),
        (
            task_event("t", dependencies=[ev.Dependency(task_id="x" * 257)]),
            "invalid_id",
            "submitted.dependencies[0].task_id: 257 bytes, at most 256 (limits.id_bytes)",
        ),
        (
            ev.TaskEvent(cell="c" * 2000, submitted=ev.TaskSpec(id="t")).SerializeToString(),
            "too_large",
            "cell: 2000 bytes",
        ),
        (
            ev.TaskEvent(failed=ev.TaskFailed(task_id="t", reason="r" * 5000)).SerializeToString(),
            "too_large",
            "failed.reason: 5000 bytes",
        ),
        (
            ev.TaskEvent(started=ev.TaskStarted(task_id="t", device_ids=["d0"] * 4097)).SerializeToString(),
            "too_large",
            "started.device_ids: 4097 entries",
        ),
    ]
    big_device = ev.Device(id="d9", host_id="h0", kind=ev.DEVICE_KIND_GPU, memory_gb=16, model="m" * 1025)
    telemetry_events = [
        (telemetry(device_upsert=big_device), "too_large", "device_upsert.model: 1025 bytes"),
        (telemetry(device_upsert=ev.Device(id="d" * 300, host_id="h0")), "invalid_id", "device_upsert.id: 300 bytes"),
        (telemetry(host_upsert=ev.Host(id="h1", labels=labels)), "too_large", "host_upsert.labels: 65 entries"),
        (telemetry(link_upsert=ev.Link(id="l", src_id="s" * 257, dst_id="d0")), "invalid_id", "link_upsert.src_id"),
        (  # read by the wire decoder: the fast path must refuse it too
            ev.TelemetryEvent(cell="c", source="s" * 2000, metrics_batch=metrics(("d0", 0.5))).SerializeToString(),
            "too_large",
            "source: 2000 bytes",
        ),
        (
            ev.TelemetryEvent(cell="c" * 1025, device_metrics=ev.DeviceMetrics(device_id="d0")).SerializeToString(),
            "too_large",
            "cell: 1025 bytes",
        ),
        (
            telemetry(metrics_batch=metrics(*[("d0", 0.5)] * 3)),
            "too_large",
            "metrics_batch.devices: 3 entries, at most 2 (limits.batch_reports)",
        ),
    ]
    return [(TOPICS.tasks, *t) for t in tasks] + [(TOPICS.telemetry, *t) for t in telemetry_events]


@pytest.mark.parametrize(
    ("topic", "record", "reason", "names"),
    [pytest.param(*case, id=case[3].split(":")[0].replace("k" * 40, "k...")) for case in over_limits()],
)
def test_a_string_list_or_map_over_its_limit_goes_to_the_dead_letter_topic_naming_field_and_limit(
    topic: str, record: bytes, reason: str, names: str
) -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus, max_event_bytes=2 << 20, limits=LimitsSettings(batch_reports=2))
    publish(bus, TOPICS.telemetry, DEVICE)
    drain(ingestor)
    graph = ingestor.scheduler.graph
    before = (graph.version, graph.metrics_version, dict(graph.tasks), float(graph.devices.utilization[0]))
    publish(bus, topic, record)
    drain(ingestor)
    assert ingestor.stats.rejected == {reason: 1}
    [dead] = bus.read_all(TOPICS.dlq)
    assert dict(dead.headers)["hlb.error.reason"] == reason.encode()
    assert names in dict(dead.headers)["hlb.error.message"].decode()
    after = (graph.version, graph.metrics_version, dict(graph.tasks), float(graph.devices.utilization[0]))
    assert after == before, "a record over the limits changed the graph"
    assert ingestor.scheduler.ledger.last_sequence == 0


def test_events_at_the_limits_are_applied() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus, max_event_bytes=1 << 20)
    spec = ev.TaskSpec(
        id="x" * 256,
        job_id="j" * 1024,
        labels={f"k{i}": "\u00e9" * 512 for i in range(64)},  # 1024 bytes each
        allowed_models=[f"m{i}" for i in range(4096)],
        memory_per_device_gb=1,
    )
    publish(bus, TOPICS.tasks, ev.TaskEvent(cell="c" * 1024, submitted=spec).SerializeToString())
    drain(ingestor)
    assert ingestor.stats.rejected == {}
    assert "x" * 256 in ingestor.scheduler.graph.tasks


# -- event times -----------------------------------------------------------------------------------

NOW_S = 1_800_000_000.0
NOW_MS = int(NOW_S * 1000)
YEAR_3000_MS = 32_503_680_000_000


def test_telemetry_dated_ahead_of_the_clock_is_refused_so_staleness_keeps_growing() -> None:
    bus = MemoryBus()
    now = [NOW_S]
    ingestor = make_ingestor(bus, clock=lambda: now[0])
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS, device_upsert=device("d0")))
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS, metrics_batch=metrics(("d0", 0.2))))
    ingestor.run_once(10, 0.0)
    now[0] += 5
    publish(bus, TOPICS.telemetry, telemetry(YEAR_3000_MS, metrics_batch=metrics(("d0", 0.9))))  # the wire path
    publish(bus, TOPICS.telemetry, telemetry(YEAR_3000_MS, device_metrics=ev.DeviceMetrics(device_id="d0")))
    publish(bus, TOPICS.telemetry, telemetry(YEAR_3000_MS, device_upsert=device("d1")))  # the protobuf path
    publish(bus, TOPICS.telemetry, telemetry(-1, device_upsert=device("d2")))
    ingestor.run_once(10, 0.0)
    now[0] += 5
    publish(bus, TOPICS.tasks, task_event("t"))  # any batch measures staleness
    ingestor.run_once(10, 0.0)

    assert list(ingestor.stats.staleness_ms) == [0.0, 5000.0, 10000.0]
    assert ingestor.stats.rejected == {"clock_skew": 4}
    dead = [dict(r.headers) for r in bus.read_all(TOPICS.dlq)]
    assert b"ahead of the daemon's clock, at most 3600 (limits.clock_skew_s)" in dead[0]["hlb.error.message"]
    assert dead[3]["hlb.error.message"] == b"event_time_ms=-1 is negative"
    graph = ingestor.scheduler.graph
    assert graph.newest_telemetry_ms == NOW_MS
    assert graph.devices.utilization[graph.devices.index["d0"]] == 0.2
    assert set(graph.devices.index) == {"d0"}


def test_telemetry_within_the_skew_and_from_the_past_is_applied() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus, clock=lambda: NOW_S)
    publish(bus, TOPICS.telemetry, telemetry(1000, device_upsert=device("d0")))  # long ago: applied
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS + 3_599_000, metrics_batch=metrics(("d0", 0.3))))
    publish(
        bus, TOPICS.tasks, ev.TaskEvent(event_time_ms=YEAR_3000_MS, submitted=ev.TaskSpec(id="t")).SerializeToString()
    )
    drain(ingestor)
    assert ingestor.stats.rejected == {}  # a task event's time is not used: not checked
    assert ingestor.scheduler.graph.newest_telemetry_ms == NOW_MS + 3_599_000


def test_a_snapshot_after_a_refused_time_from_the_future_does_not_hold_it() -> None:
    from hlb.daemon.record import snapshot

    bus = MemoryBus()
    ingestor = make_ingestor(bus, clock=lambda: NOW_S)
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS, device_upsert=device("d0")))
    publish(bus, TOPICS.telemetry, telemetry(YEAR_3000_MS, metrics_batch=metrics(("d0", 0.9))))
    drain(ingestor)
    restored = snapshot.restore_state(snapshot.state_arrays(ingestor.scheduler, ingestor.positions)).graph
    assert restored.newest_telemetry_ms == NOW_MS
    assert int(restored.devices.metrics_ms.max()) <= NOW_MS


def test_times_from_the_future_in_a_restored_graph_are_forgotten_before_the_next_batch() -> None:
    bus = MemoryBus()
    ingestor = make_ingestor(bus, clock=lambda: NOW_S)
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS - 2000, device_upsert=device("d0")))
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS - 1000, device_upsert=device("d1")))
    publish(bus, TOPICS.telemetry, telemetry(NOW_MS - 1000, metrics_batch=metrics(("d0", 0.1), ("d1", 0.1))))
    drain(ingestor)
    graph = ingestor.scheduler.graph
    # As a snapshot written before times were checked would hold them:
    graph.devices.metrics_ms[graph.devices.index["d1"]] = YEAR_3000_MS
    graph.newest_telemetry_ms = YEAR_3000_MS
    ingestor.run_once(10, 0.0)  # nothing to consume: the times are forgotten all the same
    assert graph.newest_telemetry_ms == NOW_MS - 1000
    assert graph.devices.metrics_ms[graph.devices.index["d1"]] == 0
