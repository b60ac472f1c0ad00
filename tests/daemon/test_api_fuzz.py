"""Every gRPC method fuzzed against a live server: well-formed status codes only, and a refused
request changes nothing.

The server is the real grpc.aio one on loopback, with the daemon on the in-memory bus (fast, and
the bus's topics are part of the state that must not change). hypothesis draws every field of
each request, including out-of-range numbers, NaN and infinities, unknown enum values, ids that
are empty, too long or shared with earlier tasks, and raw or mutated request bytes. Allowed
answers: OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED; never UNKNOWN
or INTERNAL. "Changes nothing" compares the canonical state dump (``hlb.daemon.record.statedump``) and the
bus's topics before and after.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import load_settings
from hlb.daemon.record.statedump import canonical_state
from hlb.daemon.runtime.daemon import Daemon
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,  # a request naming a cell other than the daemon's own
}
INVENTORY = inventory_events("default")
DEVICES = {e.device_upsert.id: e.device_upsert for e in INVENTORY if e.HasField("device_upsert")}
# Reproducible by default (the same examples every run); HLB_FAULTS_LONG=1 draws fresh, many more.
LONG = os.environ.get("HLB_FAULTS_LONG") == "1"
FUZZ = settings(
    max_examples=2000 if LONG else 120,
    derandomize=not LONG,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
INT32, INT64, UINT32, UINT64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1), (0, 2**32 - 1), (0, 2**64 - 1)


@dataclass
class Server:
    daemon: Daemon
    bus: MemoryBus
    channel: grpc.Channel
    stub: api_grpc.SchedulerStub

    def snapshot(self) -> tuple[dict[str, Any], dict[str, int]]:
        """The daemon's canonical state and the length of every topic on its bus."""
        with self.daemon.lock:
            state = canonical_state(self.daemon.scheduler)
        return state, {topic: len(records) for topic, records in self.bus.topics.items()}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # Tasks share devices here, so that accepted requests keep finding room.
    config = load_settings(
        None, bus="memory", grpc={"listen": f"127.0.0.1:{free_port()}"}, scheduler={"max_tasks_per_device": 0}
    )
    bus = MemoryBus()
    for event in INVENTORY:
        bus.publish(config.kafka.topics.telemetry, b"default", event.SerializeToString())
    daemon = Daemon(config, bus, clock=lambda: 1_800_000_000.0)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(daemon.run(stop),), daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(daemon.ready.wait(), loop).result(timeout=30)
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = api_grpc.SchedulerStub(channel)
        running = Server(daemon, bus, channel, stub)
        for _ in range(400):  # the inventory is applied by the ingest thread
            if len(running.snapshot()[0]["devices"]) == len(DEVICES):
                break
            threading.Event().wait(0.025)
        yield running
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    assert not thread.is_alive()


# -- strategies ------------------------------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=40)
# Over the default limits (limits.text_bytes 1024, limits.labels 64): refused, whatever else the request holds.
long_texts = st.sampled_from(["t" * 1025, "\u00e9" * 513])
too_many_labels = st.just({f"k{i}": "v" for i in range(65)})
ids = st.one_of(
    st.sampled_from([f"f{i}" for i in range(12)]),  # shared ids: repeats and clashes with other specs
    st.sampled_from(["", " ", "x" * 256, "x" * 257]),
    texts,
)
numbers = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 4.0, 16.0, 80.0, -1.0, 1e6, 1e6 + 1, 1e300]),
    st.floats(),  # NaN, infinities, subnormals, huge
)
kind_values = st.one_of(st.sampled_from(list(ev.DeviceKind.values())), st.integers(*INT32))
models = st.one_of(st.sampled_from(sorted({d.model for d in DEVICES.values()})), texts)


@st.composite
def task_specs(draw: st.DrawFn) -> ev.TaskSpec:
    return ev.TaskSpec(
        id=draw(ids),
        job_id=draw(st.one_of(texts, long_texts)),
        kind=ev.TaskKind.ValueType(draw(st.one_of(st.sampled_from(list(ev.TaskKind.values())), st.integers(*INT32)))),
        workload_class=draw(st.one_of(texts, long_texts)),
        num_devices=draw(st.one_of(st.integers(0, 6), st.integers(*UINT32))),
        memory_per_device_gb=draw(numbers),
        work_ref_s=draw(numbers),
        allowed_kinds=[ev.DeviceKind.ValueType(k) for k in draw(st.lists(kind_values, max_size=3))],
        allowed_models=draw(st.lists(models, max_size=2)),
        preferred_models=draw(st.lists(models, max_size=2)),
        priority=draw(st.integers(*INT32)),
        deadline_ms=draw(st.integers(*INT64)),
        latency_slo_ms=draw(numbers),
        dependencies=draw(st.lists(st.builds(ev.Dependency, task_id=ids, transfer_gb=numbers), max_size=2)),
        labels=draw(st.one_of(st.dictionaries(texts, st.one_of(texts, long_texts), max_size=2), too_many_labels)),
        submit_time_ms=draw(st.integers(*INT64)),
    )


device_ids = st.lists(st.one_of(st.sampled_from(sorted(DEVICES)), ids), max_size=6)


def call(method: Callable[..., Any], request: Any, timeout_s: float = 10.0) -> tuple[grpc.StatusCode, Any]:
    try:
        return grpc.StatusCode.OK, method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def assert_well_formed(code: grpc.StatusCode, details: Any) -> None:
    assert code in ALLOWED, f"{code}: {details}"


def over_limits(spec: ev.TaskSpec) -> bool:
    """Whether a string or map of ``spec`` is over the default limits (ids 256 bytes, other
    strings 1024, 64 labels)."""
    texts = [spec.job_id, spec.workload_class, *spec.labels, *spec.labels.values()]
    texts += [*spec.allowed_models, *spec.preferred_models]
    ids = [spec.id, *(d.task_id for d in spec.dependencies)]
    return (
        len(spec.labels) > 64 or any(len(t.encode()) > 1024 for t in texts) or any(len(i.encode()) > 256 for i in ids)
    )


def assert_feasible(spec: ev.TaskSpec, placement: ev.Placement) -> None:
    """A placement never breaks a hard constraint of its task."""
    assert len(placement.device_ids) == max(1, spec.num_devices)
    assert len(set(placement.device_ids)) == len(placement.device_ids)
    for device_id in placement.device_ids:
        device = DEVICES[device_id]
        assert not spec.allowed_kinds or device.kind in spec.allowed_kinds
        assert not spec.allowed_models or device.model in spec.allowed_models
        assert device.memory_gb >= spec.memory_per_device_gb


# -- the methods -----------------------------------------------------------------------------


def test_place_fuzzed(server: Server) -> None:
    @FUZZ
    @given(task=st.one_of(st.none(), task_specs()), dry_run=st.booleans())
    def fuzz(task: ev.TaskSpec | None, dry_run: bool) -> None:
        request = api.PlaceRequest(dry_run=dry_run) if task is None else api.PlaceRequest(task=task, dry_run=dry_run)
        before = server.snapshot()
        code, reply = call(server.stub.Place, request)
        assert_well_formed(code, reply)
        if task is not None and over_limits(task):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"a task over the limits got {code}"
        if code != grpc.StatusCode.OK or dry_run:
            assert server.snapshot() == before, f"refused or dry-run Place changed the state ({code})"
        if code == grpc.StatusCode.OK and task is not None and reply.HasField("placement"):
            assert_feasible(task, reply.placement)

    fuzz()


def test_get_placement_fuzzed(server: Server) -> None:
    @FUZZ
    @given(task_id=ids)
    def fuzz(task_id: str) -> None:
        before = server.snapshot()
        code, reply = call(server.stub.GetPlacement, api.GetPlacementRequest(task_id=task_id))
        assert_well_formed(code, reply)
        assert server.snapshot() == before
        if code == grpc.StatusCode.OK:
            answered = reply.placement.task_id if reply.HasField("placement") else reply.pending.task_id
            assert answered == task_id

    fuzz()


def test_watch_placements_fuzzed(server: Server) -> None:
    for i in range(4):  # something to watch
        server.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id=f"watched-{i}", memory_per_device_gb=0.5)), timeout=10)

    @settings(FUZZ, max_examples=FUZZ.max_examples // 5)
    @given(from_sequence=st.one_of(st.integers(0, 8), st.integers(*UINT64)))
    def fuzz(from_sequence: int) -> None:
        before = server.snapshot()
        with server.daemon.lock:
            expected = [p.sequence for p in server.daemon.scheduler.ledger.since(max(1, from_sequence))]
        seen: list[int] = []
        stream = server.stub.WatchPlacements(api.WatchPlacementsRequest(from_sequence=from_sequence), timeout=0.3)
        with pytest.raises(grpc.RpcError) as ended:
            seen.extend(p.sequence for p in stream)
        assert_well_formed(ended.value.code(), ended.value.details())
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert seen == expected
        assert server.snapshot() == before

    fuzz()


def test_get_cluster_state_and_every_method_fuzzed_with_raw_bytes(server: Server) -> None:
    valid = {
        "Place": api.PlaceRequest(task=ev.TaskSpec(id="raw", memory_per_device_gb=1)).SerializeToString(),
        "PlaceBatch": api.PlaceBatchRequest(tasks=[ev.TaskSpec(id="raw-b")]).SerializeToString(),
        "GetPlacement": api.GetPlacementRequest(task_id="watched-0").SerializeToString(),
        "WatchPlacements": api.WatchPlacementsRequest(from_sequence=2).SerializeToString(),
        "ScoreDevices": api.ScoreDevicesRequest(
            task=ev.TaskSpec(id="s"), device_ids=list(DEVICES)[:3]
        ).SerializeToString(),
        "Explain": api.ExplainRequest(task_id="watched-0", top_k=3).SerializeToString(),
        "GetClusterState": b"",
    }

    @st.composite
    def mutated(draw: st.DrawFn) -> bytes:
        value = bytearray(draw(st.sampled_from(sorted(valid.values()))))
        for _ in range(draw(st.integers(1, 3))):
            if value and draw(st.booleans()):
                value[draw(st.integers(0, len(value) - 1))] ^= 1 << draw(st.integers(0, 7))
            else:
                value = value[: draw(st.integers(0, len(value)))]
        return bytes(value)

    @settings(FUZZ, max_examples=FUZZ.max_examples * 2)
    @given(method=st.sampled_from(sorted(valid)), value=st.one_of(st.binary(max_size=120), mutated()))
    def fuzz(method: str, value: bytes) -> None:
        before = server.snapshot()
        path = f"/hlb.v1.Scheduler/{method}"
        try:
            if method == "WatchPlacements":
                list(server.channel.unary_stream(path, None, None)(value, timeout=0.2))
            else:
                server.channel.unary_unary(path, None, None)(value, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            assert_well_formed(code, details)
        if code != grpc.StatusCode.OK or method not in ("Place", "PlaceBatch"):
            assert server.snapshot() == before, f"{method} with raw bytes changed the state ({code})"

    fuzz()


def test_an_oversized_request_is_resource_exhausted_and_changes_nothing(server: Server) -> None:
    before = server.snapshot()
    huge = ev.TaskSpec(id="huge-labels", labels={"padding": "p" * (5 * 1024 * 1024)})
    code, details = call(server.stub.Place, api.PlaceRequest(task=huge))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert server.snapshot() == before


def test_place_batch_fuzzed(server: Server) -> None:
    @FUZZ
    @given(tasks=st.lists(task_specs(), max_size=4), dry_run=st.booleans())
    def fuzz(tasks: list[ev.TaskSpec], dry_run: bool) -> None:
        before = server.snapshot()
        code, reply = call(server.stub.PlaceBatch, api.PlaceBatchRequest(tasks=tasks, dry_run=dry_run))
        assert_well_formed(code, reply)
        if any(map(over_limits, tasks)):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"a batch with a task over the limits got {code}"
        if code != grpc.StatusCode.OK or dry_run:
            assert server.snapshot() == before, f"refused or dry-run PlaceBatch changed the state ({code})"
        if code == grpc.StatusCode.OK:
            assert len(reply.results) == len(tasks)
            for task, result in zip(tasks, reply.results, strict=True):
                if result.HasField("placement"):
                    assert_feasible(task, result.placement)

    fuzz()


def test_score_devices_fuzzed(server: Server) -> None:
    @FUZZ
    @given(task=st.one_of(st.none(), task_specs()), devices=device_ids)
    def fuzz(task: ev.TaskSpec | None, devices: list[str]) -> None:
        request = api.ScoreDevicesRequest(device_ids=devices)
        if task is not None:
            request.task.CopyFrom(task)
        before = server.snapshot()
        code, reply = call(server.stub.ScoreDevices, request)
        assert_well_formed(code, reply)
        assert server.snapshot() == before
        if code == grpc.StatusCode.OK:
            assert [s.device_id for s in reply.scores] == devices
            assert all(s.device_id in DEVICES for s in reply.scores if s.feasible)

    fuzz()


def test_explain_fuzzed(server: Server) -> None:
    @FUZZ
    @given(target=st.one_of(st.none(), ids, task_specs()), top_k=st.one_of(st.integers(0, 30), st.integers(*UINT32)))
    def fuzz(target: str | ev.TaskSpec | None, top_k: int) -> None:
        request = api.ExplainRequest(top_k=top_k)
        if isinstance(target, str):
            request.task_id = target
        elif target is not None:
            request.task.CopyFrom(target)
        before = server.snapshot()
        code, reply = call(server.stub.Explain, request)
        assert_well_formed(code, reply)
        assert server.snapshot() == before
        if code == grpc.StatusCode.OK:
            assert len(reply.candidates) <= (top_k or 5)

    fuzz()
