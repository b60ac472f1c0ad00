"""``/metrics`` of a running daemon (in-memory bus): values follow placements, rejections and ingest."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hlb.daemon.config import load_settings
from hlb.daemon.runtime.metrics import DaemonMetrics
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
NOW_MS = 1_800_000_000_000
DEVICES = sum(1 for e in inventory_events("default") if e.HasField("device_upsert"))


def scrape(port: int) -> Samples:
    """Every sample on the endpoint, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def wait_for(port: int, condition: Callable[[Samples], bool], timeout_s: float = 30.0) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, "metrics never reached the expected values"
        time.sleep(0.05)


@pytest.fixture
def running() -> Iterator[BackgroundDaemon]:
    settings = load_settings(
        None,
        bus="memory",
        grpc={"listen": f"127.0.0.1:{free_port()}"},
        metrics={"listen": "127.0.0.1:0", "lag_interval_s": 0.05},
        kafka={"poll_timeout_s": 0.05},
        scheduler={"policy": "least-loaded"},
    )
    with BackgroundDaemon(settings, clock=lambda: NOW_MS / 1000) as daemon:
        yield daemon


def test_the_endpoint_follows_ingest_placements_and_rejections(running: BackgroundDaemon) -> None:
    port = running.daemon.metrics_port
    topics = running.daemon.settings.kafka.topics
    before = scrape(port)
    assert value(before, "hlb_serving") == 1.0
    assert value(before, "hlb_devices") == 0.0
    assert value(before, "hlb_graph_staleness_seconds") == -1.0
    assert value(before, "hlb_policy_info", policy="least-loaded", model_version="none") == 1.0

    events = inventory_events("default")
    device = next(e.device_upsert.id for e in events if e.HasField("device_upsert"))
    # Telemetry measured 2.5 s before the (frozen) daemon clock.
    measured = ev.TelemetryEvent(
        cell="default", event_time_ms=NOW_MS - 2500, device_metrics=ev.DeviceMetrics(device_id=device, utilization=0.5)
    )
    inventory = [e.SerializeToString() for e in [*events, measured]]
    for record in inventory:
        running.bus.publish(topics.telemetry, b"default", record)
    running.bus.publish(topics.telemetry, b"default", b"\xff not an event")
    ingested = wait_for(
        port,
        lambda s: (
            value(s, "hlb_devices") == DEVICES
            and value(s, "hlb_events_rejected_total", reason="decode") == 1.0
            and value(s, "hlb_dlq_records_total", topic=topics.telemetry) == 1.0
            and value(s, "hlb_consumer_lag_messages", topic=topics.telemetry, partition="0") == 0.0
        ),
    )
    assert value(ingested, "hlb_events_applied_total") == len(inventory)
    assert value(ingested, "hlb_dlq_records_total", topic=topics.telemetry) == 1.0
    assert value(ingested, "hlb_graph_staleness_seconds") == 2.5
    assert value(ingested, "hlb_consumer_lag_messages", topic=topics.tasks, partition="0") == 0.0

    with grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        placed = stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="m1", memory_per_device_gb=8)), timeout=5)
        assert placed.HasField("placement")
        waits = stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="m2", memory_per_device_gb=10_000)), timeout=5)
        assert waits.HasField("pending")
        with pytest.raises(grpc.RpcError):
            stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="bad", memory_per_device_gb=-1)), timeout=5)

    # The client sees an aborted RPC's status before the server's interceptor has counted it.
    after = wait_for(
        port,
        lambda s: (
            value(s, "hlb_rpc_requests_total", rpc="Place", code="INVALID_ARGUMENT") == 1.0
            and value(s, "hlb_decision_latency_seconds_count", rpc="Place", policy="least-loaded") == 3.0
        ),
    )
    assert value(after, "hlb_placements_total", policy="least-loaded") == 1.0
    assert value(after, "hlb_ledger_sequence") == 1.0
    assert value(after, "hlb_pending_tasks") == 1.0
    assert value(after, "hlb_tasks_waiting_for_device") == 0.0  # least-loaded never holds a task back
    assert value(after, "hlb_running_tasks") == 1.0
    assert value(after, "hlb_tasks_held") == 2.0  # the placed task and the queued one
    assert value(after, "hlb_tasks_forgotten_total") == 0.0
    assert value(after, "hlb_rpc_requests_total", rpc="Place", code="OK") == 2.0
    assert value(after, "hlb_rpc_requests_total", rpc="Place", code="INVALID_ARGUMENT") == 1.0
    assert value(after, "hlb_decision_latency_seconds_count", rpc="Place", policy="least-loaded") == 3.0
    latency_sum = value(after, "hlb_decision_latency_seconds_sum", rpc="Place", policy="least-loaded")
    assert latency_sum is not None
    assert latency_sum > 0
    # GetClusterState is counted but is not a decision.
    assert value(after, "hlb_decision_latency_seconds_count", rpc="GetClusterState", policy="least-loaded") is None


def test_consumer_lag_counts_records_not_yet_committed(running: BackgroundDaemon) -> None:
    # The ingest thread is stopped first, so nothing consumes what is published next.
    running.daemon.ingest.stop()
    topics = running.daemon.settings.kafka.topics
    for _ in range(3):
        running.bus.publish(topics.tasks, b"default", ev.TaskEvent(cell="default").SerializeToString())
    samples = wait_for(
        running.daemon.metrics_port,
        lambda s: value(s, "hlb_consumer_lag_messages", topic=topics.tasks, partition="0") == 3.0,
    )
    assert value(samples, "hlb_consumer_lag_messages", topic=topics.telemetry, partition="0") == 0.0


def test_fallbacks_are_counted_by_reason() -> None:
    metrics = DaemonMetrics()
    metrics.record_fallback("model_missing")
    metrics.record_fallback("model_missing")
    metrics.record_fallback("schema_mismatch")
    get = metrics.registry.get_sample_value
    assert get("hlb_policy_fallbacks_total", {"reason": "model_missing"}) == 2.0
    assert get("hlb_policy_fallbacks_total", {"reason": "schema_mismatch"}) == 1.0


def test_metrics_are_off_unless_listen_is_set() -> None:
    settings = load_settings(None, bus="memory", grpc={"listen": f"127.0.0.1:{free_port()}"})
    assert settings.metrics.listen == ""
    with BackgroundDaemon(settings) as running:
        assert running.daemon.metrics_port == 0


def test_a_full_queue_shows_its_bound_and_counts_its_refusals(running: BackgroundDaemon) -> None:
    port = running.daemon.metrics_port
    assert value(scrape(port), "hlb_queue_limit") == 1_000_000.0  # the default bound
    assert value(scrape(port), "hlb_dead_letter_failures_total") == 0.0
    running.daemon.scheduler.max_pending = 1
    with grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="q1", num_devices=1000, memory_per_device_gb=1)), timeout=5)
        for task_id in ("q2", "q3"):
            with pytest.raises(grpc.RpcError):
                stub.Place(api.PlaceRequest(task=ev.TaskSpec(id=task_id, memory_per_device_gb=1)), timeout=5)
    # The client sees an aborted RPC's status before the server's interceptor has counted it.
    full = wait_for(
        port,
        lambda s: (
            value(s, "hlb_tasks_refused_queue_full_total") == 2.0
            and value(s, "hlb_rpc_requests_total", rpc="Place", code="RESOURCE_EXHAUSTED") == 2.0
        ),
    )
    assert value(full, "hlb_queue_limit") == 1.0


def test_every_counter_an_alert_reads_is_there_at_zero_before_its_first_event(running: BackgroundDaemon) -> None:
    """A counter that appears only at its first event has no earlier sample, so ``increase()``
    over it stays empty and HlbReloadRefused, HlbDeadLetters, HlbRateLimited and the like never
    fire on a first occurrence."""
    samples = scrape(running.daemon.metrics_port)
    topics = running.daemon.settings.kafka.topics
    expected = [
        ("hlb_config_reloads_total", {"result": result}) for result in ("applied", "partial", "unchanged", "invalid")
    ]
    expected += [("hlb_dlq_records_total", {"topic": topic}) for topic in (topics.telemetry, topics.tasks)]
    expected += [("hlb_rpc_rate_limited_total", {"rpc": rpc}) for rpc in ("Place", "PlaceBatch", "Explain")]
    expected += [("hlb_policy_fallbacks_total", {"reason": r}) for r in ("model_missing", "embeddings_stale")]
    expected += [("hlb_decisions_unpublished_total", {"kind": k}) for k in ("placement", "submission")]
    expected += [("hlb_events_rejected_total", {"reason": r}) for r in ("decode", "out_of_range", "wrong_cell")]
    expected += [("hlb_leases_expired_total", {"kind": k}) for k in ("start", "report")]
    expected += [("hlb_tasks_reconciled_total", {"outcome": o}) for o in ("resubmitted", "failed")]
    found = {(name, *labels.values()): value(samples, name, **labels) for name, labels in expected}
    assert found == {(name, *labels.values()): 0.0 for name, labels in expected}


def test_unit_names_follow_prometheus_conventions(running: BackgroundDaemon) -> None:
    """A ratio says ``_ratio``, a count of messages ``_messages`` (renamed: docs/monitoring.md)."""
    samples = scrape(running.daemon.metrics_port)
    assert value(samples, "hlb_mean_utilization_ratio") == 0.0
    names = {name for name, _ in samples}
    assert not {"hlb_mean_utilization", "hlb_consumer_lag"} & names


def test_an_instance_with_cells_serves_every_shards_metrics_labelled_by_cell() -> None:
    """One endpoint for the shards of an instance: each family once, each sample with its shard's
    cell and partition; a shard that stops is no longer shown."""
    from prometheus_client import generate_latest

    from hlb.daemon.cells.metrics import InstanceMetrics

    shards = {0: ("pod-a", DaemonMetrics()), 1: ("pod-b", DaemonMetrics())}
    shards[0][1].placements.labels(policy="gnn").inc(3)
    shards[1][1].placements.labels(policy="gnn").inc(5)
    shards[1][1].count_feature_record("published", 100, 4)
    instance = InstanceMetrics(lambda: [(n, cell, m.registry) for n, (cell, m) in shards.items()])
    instance.count_rate_limited("/hlb.v1.Scheduler/Place")
    registry = instance.registry

    def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
        text = generate_latest(registry).decode()
        assert text.count("# TYPE hlb_placements_total counter") == 1  # one family, both shards' samples
        return {
            family.name: [(dict(s.labels), s.value) for s in family.samples if s.name.endswith("_total")]
            for family in text_string_to_metric_families(text)
        }

    figures = scrape()
    assert sorted(figures["hlb_placements"], key=lambda s: s[0]["cell"]) == [
        ({"policy": "gnn", "cell": "pod-a", "shard": "0"}, 3.0),
        ({"policy": "gnn", "cell": "pod-b", "shard": "1"}, 5.0),
    ]
    assert ({"outcome": "published", "cell": "pod-b", "shard": "1"}, 4.0) in figures["hlb_feature_records"]
    # The rate limit is the instance's: its counter once, without a cell.
    assert ({"rpc": "Place"}, 1.0) in figures["hlb_rpc_rate_limited"]
    assert all("cell" not in labels for labels, _ in figures["hlb_rpc_rate_limited"])
    del shards[0]
    assert {labels["cell"] for labels, _ in scrape()["hlb_placements"]} == {"pod-b"}
