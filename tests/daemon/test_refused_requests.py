"""Requests the daemon cannot carry out whole are refused whole: a placement the bus refuses to
record (UNAVAILABLE, undone), a request whose deadline passed while it waited for its turn
(DEADLINE_EXCEEDED, nothing decided), and a tenant past its bound on pending tasks
(RESOURCE_EXHAUSTED naming the tenant and the limit; on Kafka a dead letter)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Settings
from hlb.daemon.decide.scheduler import STOP_CHECK_EVERY
from hlb.daemon.serve.api import SchedulerService
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.daemon.background import wait_until as _wait

CELL = "default"
DEVICES = sum(e.HasField("device_upsert") for e in inventory_events(CELL))


@dataclass
class RefusingBus(MemoryBus):
    """A memory bus whose producer refuses every record for the topics in ``refused`` at once, as
    librdkafka refuses a record it cannot queue (``KafkaException``)."""

    refused: set[str] = field(default_factory=set)

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        if topic in self.refused:
            raise RuntimeError("KafkaError{code=MSG_SIZE_TOO_LARGE}")
        super().publish(topic, key, value, headers)


def _spec(task_id: str, devices: int = 1) -> ev.TaskSpec:
    return ev.TaskSpec(id=task_id, num_devices=devices, memory_per_device_gb=1)


def _refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as failure:
        call()
    error: Any = failure.value
    return error.code(), error.details() or ""


@dataclass
class Served:
    running: BackgroundDaemon
    bus: RefusingBus
    settings: Settings
    stub: api_grpc.SchedulerStub

    def placements(self) -> list[ev.Placement]:
        records = self.bus.read_all(self.settings.kafka.topics.placements)
        return [ev.Placement.FromString(r.value or b"") for r in records]

    def submitted(self) -> list[str]:
        records = self.bus.read_all(self.settings.kafka.topics.tasks)
        return [ev.TaskEvent.FromString(r.value or b"").submitted.id for r in records]


@contextlib.contextmanager
def _serve(tmp_path: Path, *, journal: bool = False, **overrides: Any) -> Iterator[Served]:
    settings = memory_settings(tmp_path, scheduler={"policy": "least-loaded"}, **overrides)
    bus = RefusingBus()
    for event in inventory_events(CELL):
        bus.publish(settings.kafka.topics.telemetry, CELL.encode(), event.SerializeToString())
    running = BackgroundDaemon(settings, bus)
    running.daemon.journal_enabled = journal  # on by default with Kafka only
    with running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        _wait(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == DEVICES, "devices")
        yield Served(running, bus, settings, stub)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with _serve(tmp_path) as running:
        yield running


# -- a placement the bus refuses to record ---------------------------------------------------------


def test_a_place_whose_placement_the_bus_refuses_is_unavailable_and_undone(served: Served) -> None:
    stub, daemon = served.stub, served.running.daemon
    first = stub.Place(api.PlaceRequest(task=_spec("first")), timeout=5).placement
    served.bus.refused = {served.settings.kafka.topics.placements}

    code, details = _refusal(lambda: stub.Place(api.PlaceRequest(task=_spec("refused")), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE  # not UNKNOWN
    assert "could not be published to the ledger topic" in details
    assert "MSG_SIZE_TOO_LARGE" in details
    assert "it was not recorded" in details
    assert "may be retried" in details
    # Nothing of it is left: no task, no reservation, no ledger entry, nothing on the bus.
    code, _ = _refusal(lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="refused"), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND
    with daemon.lock:
        assert "refused" not in daemon.scheduler.graph.tasks
        assert daemon.ledger.get("refused") is None
    state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.running_tasks) == (0, 1)
    assert [p.task_id for p in served.placements()] == ["first"]
    assert served.submitted() == ["first"]
    assert daemon.metrics.registry.get_sample_value("hlb_decisions_unpublished_total", {"kind": "placement"}) == 1.0

    # Retried once the bus takes records again: decided afresh, under a number never given before.
    served.bus.refused = set()
    again = stub.Place(api.PlaceRequest(task=_spec("refused")), timeout=5).placement
    assert again.sequence > first.sequence + 1
    assert [(p.task_id, p.sequence) for p in served.placements()] == [("first", 1), ("refused", again.sequence)]
    assert served.submitted() == ["first", "refused"]


def test_a_batch_whose_placements_the_bus_refuses_is_unavailable_and_leaves_none_of_them(served: Served) -> None:
    stub, daemon = served.stub, served.running.daemon
    queued = stub.Place(api.PlaceRequest(task=_spec("queued-before", devices=1000)), timeout=5)
    assert queued.HasField("pending")
    served.bus.refused = {served.settings.kafka.topics.placements}
    batch = api.PlaceBatchRequest(tasks=[_spec("b0"), _spec("b1"), _spec("b2", devices=1000)])

    code, details = _refusal(lambda: stub.PlaceBatch(batch, timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "'b0', 'b1'" in details
    assert "'b2'" not in details
    for request in (api.GetPlacementRequest(task_id="b0"), api.GetPlacementRequest(task_id="b1")):
        code, _ = _refusal(functools.partial(stub.GetPlacement, request, timeout=5))
        assert code == grpc.StatusCode.NOT_FOUND
    # b2 was decided (pending) and recorded: a retry of the batch answers it as it stands.
    assert stub.GetPlacement(api.GetPlacementRequest(task_id="b2"), timeout=5).HasField("pending")
    assert served.submitted() == ["queued-before", "b2"]
    state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.running_tasks) == (2, 0)
    assert served.placements() == []

    served.bus.refused = set()
    results = stub.PlaceBatch(batch, timeout=5).results
    assert [r.HasField("placement") for r in results] == [True, True, False]
    assert [p.task_id for p in served.placements()] == ["b0", "b1"]
    with daemon.lock:
        assert daemon.scheduler.pending_count == 2


def test_a_submission_the_bus_refuses_to_record_is_unavailable_and_undone(served: Served) -> None:
    served.bus.refused = {served.settings.kafka.topics.tasks}
    code, details = _refusal(lambda: served.stub.Place(api.PlaceRequest(task=_spec("unrecorded")), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "'unrecorded'" in details
    with served.running.daemon.lock:
        assert "unrecorded" not in served.running.daemon.scheduler.graph.tasks
    state = served.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
    assert (state.pending_tasks, state.running_tasks) == (0, 0)


def test_a_task_ingest_placed_that_the_bus_refuses_is_queued_again_and_ingest_goes_on(served: Served) -> None:
    topics = served.settings.kafka.topics
    served.bus.refused = {topics.placements}
    event = ev.TaskEvent(cell=CELL, submitted=_spec("from-kafka"))
    served.bus.publish(topics.tasks, CELL.encode(), event.SerializeToString())
    daemon = served.running.daemon

    def unpublished() -> float:
        value = daemon.metrics.registry.get_sample_value("hlb_decisions_unpublished_total", {"kind": "placement"})
        return value or 0.0

    _wait(lambda: unpublished() >= 1, "the refused placement")
    with daemon.lock:
        assert daemon.ledger.get("from-kafka") is None
    pending = served.stub.GetPlacement(api.GetPlacementRequest(task_id="from-kafka"), timeout=5)
    assert pending.HasField("pending")  # queued again, not bound
    served.bus.refused = set()
    served.bus.publish(topics.tasks, CELL.encode(), ev.TaskEvent(cell=CELL).SerializeToString())  # a next pass
    _wait(lambda: [p.task_id for p in served.placements()] == ["from-kafka"], "the placement recorded")
    assert served.running.daemon.ingest.is_alive()


def test_through_the_journal_a_refused_placement_is_kept_and_handed_over_once_the_bus_takes_it(
    tmp_path: Path,
) -> None:
    with _serve(tmp_path, journal=True) as served:
        daemon = served.running.daemon
        served.bus.refused = {served.settings.kafka.topics.placements}
        # The journal holds the decision before the producer gets it: the answer stands.
        placed = served.stub.Place(api.PlaceRequest(task=_spec("journaled")), timeout=5).placement
        assert placed.task_id == "journaled"
        assert served.placements() == []
        registry = daemon.metrics.registry
        _wait(lambda: (registry.get_sample_value("hlb_journal_handover_failures_total") or 0) >= 2, "retries")
        journal = daemon.journal
        assert journal is not None
        assert len(journal) >= 1  # not dropped while the producer refuses it
        served.bus.refused = set()
        _wait(lambda: served.placements() == [placed], "the placement handed over")
        assert served.submitted() == ["journaled"]


# -- a deadline that passes while the request waits for its turn -------------------------------------


class AbortedError(Exception):
    pass


class _Context:
    """A servicer context whose deadline passes once the request holds the daemon's lock."""

    def __init__(self) -> None:
        self.remaining = 5.0

    def time_remaining(self) -> float:
        return self.remaining

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortedError(code, details)


class _SlowLock:
    """The daemon's lock, taken after the caller's deadline has passed (it waited behind others)."""

    def __init__(self, lock: threading.RLock, context: _Context) -> None:
        self._lock, self._context = lock, context

    def __enter__(self) -> None:
        self._lock.acquire()
        self._context.remaining = 0.0

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("method", ["Place", "PlaceBatch"])
def test_a_request_whose_deadline_passes_while_it_waits_for_its_turn_is_abandoned(served: Served, method: str) -> None:
    daemon = served.running.daemon
    context = _Context()
    lock: Any = _SlowLock(daemon.lock, context)
    service = SchedulerService(daemon.scheduler, lock, lambda spec: None)
    request: Any = (
        api.PlaceRequest(task=_spec("late"))
        if method == "Place"
        else api.PlaceBatchRequest(tasks=[_spec("late"), _spec("later")])
    )
    ctx: Any = context
    with pytest.raises(AbortedError) as refused:
        asyncio.run(getattr(service, method)(request, ctx))
    assert refused.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "nothing was decided" in refused.value.args[1]
    with daemon.lock:
        assert "late" not in daemon.scheduler.graph.tasks
        assert daemon.ledger.last_sequence == 0
    assert served.placements() == []


class _ExpiringContext(_Context):
    """A servicer context whose deadline passes after ``answers`` questions about it."""

    def __init__(self, answers: int) -> None:
        super().__init__()
        self.answers = answers

    def time_remaining(self) -> float:
        self.answers -= 1
        return 5.0 if self.answers >= 0 else 0.0


def test_a_batch_whose_deadline_passes_part_way_stops_there_and_says_what_stands(served: Served) -> None:
    daemon = served.running.daemon
    # Asked before the lock, under it, then every STOP_CHECK_EVERY tasks: gone at the second of those.
    context: Any = _ExpiringContext(answers=3)
    service = SchedulerService(daemon.scheduler, daemon.lock, lambda spec: None)
    request = api.PlaceBatchRequest(tasks=[_spec(f"b{i}", devices=1000) for i in range(100)])  # all stay queued
    with pytest.raises(AbortedError) as refused:
        asyncio.run(service.PlaceBatch(request, context))
    code, details = refused.value.args
    decided = 2 * STOP_CHECK_EVERY
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert details == (
        f"deadline passed after {decided} of 100 tasks were decided, highest priority first: those stand"
        f" (the same batch again answers them), the other {100 - decided} were not submitted"
    )
    with daemon.lock:
        known = [f"b{i}" for i in range(100) if f"b{i}" in daemon.scheduler.graph.tasks]
    assert known == [f"b{i}" for i in range(decided)]  # one priority: request order
    # The same batch again, with time to spare, answers the rest.
    again = served.stub.PlaceBatch(request, timeout=10)
    assert [r.pending.task_id for r in again.results] == [f"b{i}" for i in range(100)]


# -- a bound on each tenant's pending tasks ----------------------------------------------------------


def test_a_tenant_past_its_bound_is_refused_naming_tenant_and_limit_and_others_go_on(tmp_path: Path) -> None:
    with _serve(tmp_path, limits={"max_pending_per_tenant": 2}) as served:
        stub = served.stub
        for task_id in ("team-a/1", "team-a/2"):  # too big to place: they stay pending
            assert stub.Place(api.PlaceRequest(task=_spec(task_id, devices=1000)), timeout=5).HasField("pending")
        code, details = _refusal(lambda: stub.Place(api.PlaceRequest(task=_spec("team-a/3")), timeout=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details == (
            "tenant 'team-a' has 2 tasks pending and 1 new would exceed limits.max_pending_per_tenant (2); "
            "try again later"
        )
        batch = api.PlaceBatchRequest(tasks=[_spec("team-b/1", devices=1000), _spec("team-a/4")])
        code, details = _refusal(lambda: stub.PlaceBatch(batch, timeout=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'team-a'" in details
        code, _ = _refusal(lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="team-b/1"), timeout=5))
        assert code == grpc.StatusCode.NOT_FOUND  # the batch was refused whole
        # Another tenant, and the default tenant, are not held back by team-a's backlog.
        assert stub.Place(api.PlaceRequest(task=_spec("team-b/1", devices=1000)), timeout=5).HasField("pending")
        assert stub.Place(api.PlaceRequest(task=_spec("plain")), timeout=5).HasField("placement")
        # A task already known is answered as before: it is no new task.
        assert stub.Place(api.PlaceRequest(task=_spec("team-a/1", devices=1000)), timeout=5).HasField("pending")
        registry = served.running.daemon.metrics.registry
        assert registry.get_sample_value("hlb_tenant_pending_refused_total") == 3.0

        # A Kafka submission past the bound goes to the dead-letter topic, with its reason.
        topics = served.settings.kafka.topics
        event = ev.TaskEvent(cell=CELL, submitted=_spec("team-a/kafka"))
        served.bus.publish(topics.tasks, CELL.encode(), event.SerializeToString())

        def reasons() -> list[bytes]:
            return [dict(r.headers).get("hlb.error.reason", b"") for r in served.bus.read_all(topics.dlq)]

        _wait(lambda: reasons() == [b"tenant_queue_full"], "the dead letter")
        # Once one of team-a's tasks leaves the queue, team-a may submit again.
        cancel = ev.TaskEvent(cell=CELL, cancelled=ev.EntityRef(id="team-a/1"))
        served.bus.publish(topics.tasks, CELL.encode(), cancel.SerializeToString())
        _wait(lambda: served.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).pending_tasks == 2, "cancel")
        assert stub.Place(api.PlaceRequest(task=_spec("team-a/3")), timeout=5).HasField("placement")


def test_the_bound_per_tenant_is_off_by_default(served: Served) -> None:
    assert served.settings.limits.max_pending_per_tenant == 0
    for i in range(5):
        served.stub.Place(api.PlaceRequest(task=_spec(f"team-a/{i}", devices=1000)), timeout=5)
    assert served.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).pending_tasks == 5
