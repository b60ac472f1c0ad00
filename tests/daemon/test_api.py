"""The gRPC API on a real server over loopback, with the daemon on the in-memory bus."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import load_settings
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.serve.api import SchedulerService
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

MODELS = {e.device_upsert.id: e.device_upsert.model for e in inventory_events("default") if e.HasField("device_upsert")}


@dataclass
class Running:
    daemon: Daemon
    bus: MemoryBus
    channel: grpc.Channel
    stub: api_grpc.SchedulerStub


@pytest.fixture
def running() -> Iterator[Running]:
    settings = load_settings(None, bus="memory", grpc={"listen": f"127.0.0.1:{free_port()}"})
    bus = MemoryBus()
    for event in inventory_events("default"):
        bus.publish(settings.kafka.topics.telemetry, b"default", event.SerializeToString())
    daemon = Daemon(settings, bus, clock=lambda: 1_800_000_000.0)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(daemon.run(stop),), daemon=True)
    thread.start()
    ready = asyncio.run_coroutine_threadsafe(daemon.ready.wait(), loop)
    ready.result(timeout=30)
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = api_grpc.SchedulerStub(channel)
        # Inventory applied: the cluster state shows every device.
        for _ in range(200):
            if stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == 24:
                break
            threading.Event().wait(0.05)
        yield Running(daemon, bus, channel, stub)
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    assert not thread.is_alive()


def test_place_returns_a_feasible_placement_and_publishes_it(running: Running) -> None:
    spec = ev.TaskSpec(id="p1", num_devices=2, memory_per_device_gb=70, allowed_kinds=[ev.DEVICE_KIND_GPU])
    reply = running.stub.Place(api.PlaceRequest(task=spec), timeout=5)
    assert reply.HasField("placement")
    assert reply.placement.sequence == 1
    assert {MODELS[d] for d in reply.placement.device_ids} == {"A100-SXM4-80GB"}
    got = running.stub.GetPlacement(api.GetPlacementRequest(task_id="p1"), timeout=5)
    assert got.placement == reply.placement
    topics = running.daemon.settings.kafka.topics
    published = [ev.Placement.FromString(r.value or b"") for r in running.bus.read_all(topics.placements)]
    assert published == [reply.placement]
    # The accepted task is also recorded on the tasks topic, so a restart can replay it.
    submitted = [ev.TaskEvent.FromString(r.value or b"") for r in running.bus.read_all(topics.tasks)]
    assert [e.submitted.id for e in submitted] == ["p1"]


def test_place_is_idempotent_for_the_same_task(running: Running) -> None:
    spec = ev.TaskSpec(id="same", memory_per_device_gb=1)
    first = running.stub.Place(api.PlaceRequest(task=spec), timeout=5)
    second = running.stub.Place(api.PlaceRequest(task=spec), timeout=5)
    assert first.placement == second.placement
    assert running.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).last_sequence == 1


def test_dry_run_places_nothing(running: Running) -> None:
    reply = running.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="dry"), dry_run=True), timeout=5)
    assert reply.HasField("placement")
    assert reply.placement.sequence == 0
    with pytest.raises(grpc.RpcError) as missing:
        running.stub.GetPlacement(api.GetPlacementRequest(task_id="dry"), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_unplaceable_task_is_pending_with_its_queue_position(running: Running) -> None:
    spec = ev.TaskSpec(id="huge", memory_per_device_gb=500)
    reply = running.stub.Place(api.PlaceRequest(task=spec), timeout=5)
    assert reply.HasField("pending")
    assert reply.pending.queue_position == 1
    assert "memory" in reply.pending.reason
    got = running.stub.GetPlacement(api.GetPlacementRequest(task_id="huge"), timeout=5)
    assert got.pending.queue_position == 1


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (api.PlaceRequest(), "task"),
        (api.PlaceRequest(task=ev.TaskSpec(id="")), "task: empty id"),
        (api.PlaceRequest(task=ev.TaskSpec(id="m", memory_per_device_gb=-2)), "memory_per_device_gb"),
    ],
)
def test_invalid_place_requests_name_the_field_and_change_nothing(
    running: Running, request_: api.PlaceRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        running.stub.Place(request_, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (refused.value.details() or "")
    state = running.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.running_tasks, state.last_sequence) == (0, 0, 0)


def test_get_placement_validates_and_reports_unknown_tasks(running: Running) -> None:
    with pytest.raises(grpc.RpcError) as empty:
        running.stub.GetPlacement(api.GetPlacementRequest(), timeout=5)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as unknown:
        running.stub.GetPlacement(api.GetPlacementRequest(task_id="nope"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_placements_resumes_from_a_sequence_without_gaps(running: Running) -> None:
    for i in range(5):
        running.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id=f"w{i}", memory_per_device_gb=1)), timeout=5)
    stream = running.stub.WatchPlacements(api.WatchPlacementsRequest(from_sequence=3), timeout=10)
    seen = [p.sequence for p in itertools.islice(stream, 3)]
    # A placement made while the stream is open arrives on it too.
    running.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="late", memory_per_device_gb=1)), timeout=5)
    [late] = itertools.islice(stream, 1)
    stream.cancel()  # type: ignore[no-untyped-call]
    assert seen == [3, 4, 5]
    assert (late.sequence, late.task_id) == (6, "late")


def test_tasks_arriving_on_the_bus_are_placed_and_visible_over_grpc(running: Running) -> None:
    topics = running.daemon.settings.kafka.topics
    event = ev.TaskEvent(submitted=ev.TaskSpec(id="from-bus", allowed_kinds=[ev.DEVICE_KIND_TPU]))
    running.bus.publish(topics.tasks, b"default", event.SerializeToString())
    stream = running.stub.WatchPlacements(api.WatchPlacementsRequest(), timeout=10)
    [placement] = itertools.islice(stream, 1)
    stream.cancel()  # type: ignore[no-untyped-call]
    assert placement.task_id == "from-bus"
    assert {MODELS[d] for d in placement.device_ids} == {"TPU-v4"}


def test_place_batch_places_jointly_by_priority_and_answers_in_request_order(running: Running) -> None:
    a100 = [ev.TaskSpec(id=f"b{i}", memory_per_device_gb=70, priority=i % 2) for i in range(6)]
    reply = running.stub.PlaceBatch(api.PlaceBatchRequest(tasks=a100), timeout=5)
    assert [r.placement.task_id or r.pending.task_id for r in reply.results] == [f"b{i}" for i in range(6)]
    placed = [r.placement for r in reply.results if r.HasField("placement")]
    # Four A100s have 80 GB: the three priority-1 tasks go first, then one of priority 0.
    assert sorted(p.task_id for p in placed) == ["b0", "b1", "b3", "b5"]
    assert len({d for p in placed for d in p.device_ids}) == 4
    pending = [r.pending for r in reply.results if r.HasField("pending")]
    assert [p.queue_position for p in pending] == [1, 2]
    topics = running.daemon.settings.kafka.topics
    submitted = [ev.TaskEvent.FromString(r.value or b"").submitted.id for r in running.bus.read_all(topics.tasks)]
    assert sorted(submitted) == [f"b{i}" for i in range(6)]


def test_a_dry_run_batch_changes_nothing(running: Running) -> None:
    specs = [ev.TaskSpec(id=f"d{i}", memory_per_device_gb=70) for i in range(5)]
    reply = running.stub.PlaceBatch(api.PlaceBatchRequest(tasks=specs, dry_run=True), timeout=5)
    assert sum(r.HasField("placement") for r in reply.results) == 4  # later ones saw earlier ones' memory
    state = running.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.running_tasks, state.last_sequence) == (0, 0, 0)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (api.PlaceBatchRequest(tasks=[ev.TaskSpec(id="ok"), ev.TaskSpec(id="")]), "tasks[1]: task: empty id"),
        (api.PlaceBatchRequest(tasks=[ev.TaskSpec(id="x"), ev.TaskSpec(id="x")]), "tasks[1]: task x appears twice"),
        (api.PlaceBatchRequest(tasks=[ev.TaskSpec(id=f"t{i}") for i in range(10_001)]), "at most 10000"),
    ],
)
def test_invalid_batches_name_the_field_and_change_nothing(
    running: Running, request_: api.PlaceBatchRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        running.stub.PlaceBatch(request_, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (refused.value.details() or "")
    state = running.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.last_sequence) == (0, 0)


def test_score_devices_scores_the_callers_candidates_and_flags_infeasible_ones(running: Running) -> None:
    gpu = "rack-001/host-00/dev0"
    tpu = "rack-003/host-00/dev0"
    spec = ev.TaskSpec(id="s", memory_per_device_gb=40, allowed_kinds=[ev.DEVICE_KIND_GPU])
    small = "rack-002/host-00/dev0"
    request = api.ScoreDevicesRequest(task=spec, device_ids=[tpu, gpu, small, "ghost"])
    reply = running.stub.ScoreDevices(request, timeout=5)
    assert reply.policy == "gnn"  # the default
    assert [(s.device_id, s.feasible, s.reason) for s in reply.scores] == [
        (tpu, False, "kind"),
        (gpu, True, ""),
        (small, False, "memory"),
        ("ghost", False, "unknown device"),
    ]
    for bad, field in [
        (api.ScoreDevicesRequest(device_ids=[gpu]), "task: required"),
        (api.ScoreDevicesRequest(task=spec), "device_ids"),
        (api.ScoreDevicesRequest(task=ev.TaskSpec(id=""), device_ids=[gpu]), "task: task: empty id"),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            running.stub.ScoreDevices(bad, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (refused.value.details() or "")


def test_explain_gives_candidates_exclusions_and_the_pending_reason(running: Running) -> None:
    spec = ev.TaskSpec(id="e", memory_per_device_gb=40, allowed_kinds=[ev.DEVICE_KIND_GPU])
    reply = running.stub.Explain(api.ExplainRequest(task=spec, top_k=3), timeout=5)
    assert len(reply.candidates) == 3
    assert {MODELS[c.device_id] for c in reply.candidates} == {"A100-SXM4-80GB"}
    assert [c.score for c in reply.candidates] == sorted((c.score for c in reply.candidates), reverse=True)
    reasons = {e.device_id: e.reason for e in reply.excluded}
    assert reasons["rack-003/host-00/dev0"].startswith("kind:")
    assert reasons["rack-000/host-00/dev0"].startswith("memory:")
    assert reply.HasField("placement")  # hypothetical: what would happen now
    running.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="waits", memory_per_device_gb=500)), timeout=5)
    waiting = running.stub.Explain(api.ExplainRequest(task_id="waits"), timeout=5)
    assert waiting.pending.queue_position == 1
    assert "memory" in waiting.pending.reason
    with pytest.raises(grpc.RpcError) as unknown:
        running.stub.Explain(api.ExplainRequest(task_id="ghost"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as empty:
        running.stub.Explain(api.ExplainRequest(), timeout=5)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "target" in (empty.value.details() or "")


class AbortedError(Exception):
    pass


class _ExpiredContext:
    """A servicer context whose deadline has passed."""

    def time_remaining(self) -> float:
        return 0.0

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortedError(code, details)


def test_a_request_past_its_deadline_is_refused_before_any_work(running: Running) -> None:
    service = SchedulerService(running.daemon.scheduler, running.daemon.lock, lambda spec: None)
    context: Any = _ExpiredContext()
    with pytest.raises(AbortedError) as refused:
        asyncio.run(service.Place(api.PlaceRequest(task=ev.TaskSpec(id="late")), context))
    assert refused.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "late" not in running.daemon.scheduler.graph.tasks


def test_health_and_reflection_are_served(running: Running) -> None:
    health = health_pb2_grpc.HealthStub(running.channel)
    for service in ("", "hlb.v1.Scheduler"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for s in next(replies).list_services_response.service}
    assert {"hlb.v1.Scheduler", "grpc.health.v1.Health"} <= names


def call_raw(channel: grpc.Channel, method: str, value: bytes) -> None:
    """Call ``method`` with ``value`` as the serialized request, reading a stream to its end."""
    path = f"/hlb.v1.Scheduler/{method}"
    if method == "WatchPlacements":
        list(channel.unary_stream(path, None, None)(value, timeout=5))
    else:
        channel.unary_unary(path, None, None)(value, timeout=5)


@pytest.mark.parametrize("method", ["Place", "GetPlacement", "GetClusterState", "WatchPlacements"])
def test_request_bytes_that_do_not_decode_are_invalid_argument(running: Running, method: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call_raw(running.channel, method, b"\xff\xff\xff")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in (refused.value.details() or "")


def test_a_place_over_the_limits_is_refused_before_anything_is_reserved_numbered_or_recorded(
    running: Running,
) -> None:
    huge = ev.TaskSpec(id="huge-job", job_id="j" * 1_000_100, memory_per_device_gb=1)
    with pytest.raises(grpc.RpcError) as refused:
        running.stub.Place(api.PlaceRequest(task=huge), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "task.job_id: 1000100 bytes, at most 1024 (limits.text_bytes)"
    with pytest.raises(grpc.RpcError) as unknown:
        running.stub.GetPlacement(api.GetPlacementRequest(task_id="huge-job"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    topics = running.daemon.settings.kafka.topics
    assert running.bus.read_all(topics.tasks) == []  # not recorded for a replay either
    assert running.bus.read_all(topics.placements) == []
    # Nothing was numbered: the next decision is the first.
    reply = running.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="next", memory_per_device_gb=1)), timeout=5)
    assert reply.placement.sequence == 1


@pytest.mark.parametrize(
    ("method", "request_", "says"),
    [
        (
            "PlaceBatch",
            api.PlaceBatchRequest(tasks=[ev.TaskSpec(id="ok"), ev.TaskSpec(id="b", labels={"k": "v" * 1025})]),
            "tasks[1].labels['k']: 1025 bytes, at most 1024 (limits.text_bytes)",
        ),
        (
            "PlaceBatch",
            api.PlaceBatchRequest(tasks=[ev.TaskSpec(id="d", dependencies=[ev.Dependency(task_id="x" * 300)])]),
            "tasks[0].dependencies[0].task_id: 300 bytes, at most 256 (limits.id_bytes)",
        ),
        (
            "Place",
            api.PlaceRequest(task=ev.TaskSpec(id="m", allowed_models=["m"] * 4097)),
            "task.allowed_models: 4097 entries, at most 4096 (limits.list_items)",
        ),
        (
            "Place",
            api.PlaceRequest(task=ev.TaskSpec(id="c"), cell="c" * 1025),
            "cell: 1025 bytes, at most 1024 (limits.text_bytes)",
        ),
        (
            "ScoreDevices",
            api.ScoreDevicesRequest(task=ev.TaskSpec(id="s"), device_ids=["gpu-0", "x" * 257]),
            "device_ids[1]: 257 bytes, at most 256 (limits.id_bytes)",
        ),
        (
            "Explain",
            api.ExplainRequest(task_id="x" * 1_000_000),
            "task_id: 1000000 bytes, at most 256 (limits.id_bytes)",
        ),
        (
            "GetPlacement",
            api.GetPlacementRequest(task_id="x" * 257),
            "task_id: 257 bytes, at most 256 (limits.id_bytes)",
        ),
        ("GetClusterState", api.GetClusterStateRequest(cell="c" * 2000), "cell: 2000 bytes"),
    ],
)
def test_every_request_over_the_limits_is_invalid_argument_naming_field_and_limit(
    running: Running, method: str, request_: Any, says: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        getattr(running.stub, method)(request_, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in (refused.value.details() or "")
    state = running.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.running_tasks, state.last_sequence) == (0, 0, 0)


def test_watch_placements_with_a_cell_over_the_limit_is_invalid_argument(running: Running) -> None:
    stream = running.stub.WatchPlacements(api.WatchPlacementsRequest(cell="c" * 1025), timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(stream))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cell: 1025 bytes" in (refused.value.details() or "")


def test_a_full_queue_answers_resource_exhausted_and_frees_up_as_it_drains(running: Running) -> None:
    running.daemon.scheduler.max_pending = 1
    never = ev.TaskSpec(id="never", num_devices=1000, memory_per_device_gb=1)  # stays queued
    assert running.stub.Place(api.PlaceRequest(task=never), timeout=5).HasField("pending")
    with pytest.raises(grpc.RpcError) as refused:
        running.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="late", memory_per_device_gb=1)), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "scheduler.max_pending" in (refused.value.details() or "")
    with pytest.raises(grpc.RpcError) as batch:
        running.stub.PlaceBatch(api.PlaceBatchRequest(tasks=[ev.TaskSpec(id="b1", memory_per_device_gb=1)]), timeout=5)
    assert batch.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError):
        running.stub.GetPlacement(api.GetPlacementRequest(task_id="late"), timeout=5)  # nothing of it was kept
    running.daemon.scheduler.max_pending = 2
    assert running.stub.Place(
        api.PlaceRequest(task=ev.TaskSpec(id="late", memory_per_device_gb=1)), timeout=5
    ).HasField("placement")
