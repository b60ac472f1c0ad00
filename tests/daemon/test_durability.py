"""A Place answer survives a crash, a restarted daemon decides nothing before its replay has caught up,
and a corrupt journal record costs that record only, never a sequence number given twice."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hlb.daemon.bus.seam import MemoryBus, MemorySource, Offsets, RawEvent
from hlb.daemon.config import Settings
from hlb.daemon.record.journal import JOURNAL_NAME, RECORD_HEADER_BYTES
from hlb.daemon.runtime.restore import ReplayProgress
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, has_placement, memory_settings
from tests.daemon.background import wait_until as _wait
from tests.daemon.journal_layout import record_starts

CELL = "default"
SPEC = ev.TaskSpec(id="answered", memory_per_device_gb=4.0, workload_class="resnet50", work_ref_s=60.0)


def _publish_inventory(bus: MemoryBus, settings: Settings) -> int:
    events = inventory_events(CELL)
    for event in events:
        bus.publish(settings.kafka.topics.telemetry, CELL.encode(), event.SerializeToString())
    return sum(e.HasField("device_upsert") for e in events)


class HeldBus(MemoryBus):
    """A memory bus whose consumers get nothing until ``release`` is set: a replay that takes its time."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> MemorySource:
        bus = self

        class Held(MemorySource):
            def next_batch(self, max_events: int, timeout_s: float) -> list[RawEvent]:
                if not bus.release.wait(timeout_s):
                    return []
                return super().next_batch(max_events, timeout_s)

        return Held(self, tuple(topics), group_id, start)


def _health(target: str) -> int | None:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return None  # not listening yet
        status: int = reply.status
        return status


def test_a_started_daemon_refuses_decisions_until_its_replay_reaches_the_start_watermarks(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path)
    bus = HeldBus()
    devices = _publish_inventory(bus, settings)
    submitted = ev.TaskEvent(cell=CELL, submitted=ev.TaskSpec(id="before-start", memory_per_device_gb=1.0))
    bus.publish(settings.kafka.topics.tasks, CELL.encode(), submitted.SerializeToString())
    decided = ev.Placement(task_id="decided-earlier", cell=CELL, device_ids=["d0"], sequence=1, policy="rules")
    bus.publish(settings.kafka.topics.placements, CELL.encode(), decided.SerializeToString())
    with BackgroundDaemon(settings, bus, wait_ready=False) as running:
        target = f"127.0.0.1:{settings.grpc.listen.rsplit(':', 1)[1]}"
        _wait(lambda: _health(target) is not None, "the gRPC server to listen")
        assert _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            for call in (
                lambda: stub.Place(api.PlaceRequest(task=SPEC), timeout=5),
                lambda: stub.PlaceBatch(api.PlaceBatchRequest(tasks=[SPEC]), timeout=5),
                lambda: stub.GetPlacement(api.GetPlacementRequest(task_id="before-start"), timeout=5),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                details = refused.value.details() or ""
                assert "replaying the inputs after a start: 68 records left before decisions are served" in details
            # A placement decided before the start is answered meanwhile, from the ledger.
            earlier = stub.GetPlacement(api.GetPlacementRequest(task_id="decided-earlier"), timeout=5)
            assert list(earlier.placement.device_ids) == ["d0"]
            assert stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == 0  # nothing applied
            assert not running.daemon.ready.is_set()
            assert running.daemon.scheduler.ledger.since(1) == [decided]  # nothing decided either

            bus.release.set()
            _wait(lambda: _health(target) == health_pb2.HealthCheckResponse.SERVING, "SERVING after the replay")
            state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
            assert state.devices == devices  # everything published before the start is in the graph
            earlier = stub.GetPlacement(api.GetPlacementRequest(task_id="before-start"), timeout=5)
            assert earlier.HasField("placement")
            assert stub.Place(api.PlaceRequest(task=SPEC), timeout=5).HasField("placement")


class LossyBus(MemoryBus):
    """A memory bus whose producer loses what it is given for ``lost_topics`` (the broker never got it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost_topics: set[str] = set()
        self.lost = 0

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        if topic in self.lost_topics:
            self.lost += 1
            return
        super().publish(topic, key, value, headers)

    def flush(self, timeout_s: float) -> int:
        return self.lost  # never delivered


def _journaled(settings: Settings, bus: MemoryBus) -> BackgroundDaemon:
    running = BackgroundDaemon(settings, bus)
    running.daemon.journal_enabled = True  # on by default with Kafka only
    return running


@pytest.mark.parametrize("sync", ["write", "fsync"])
def test_a_place_answer_whose_records_never_reached_the_bus_is_kept_after_a_restart(tmp_path: Path, sync: str) -> None:
    settings = memory_settings(tmp_path, sync)
    topics = settings.kafka.topics
    bus = LossyBus()
    devices = _publish_inventory(bus, settings)
    first = _journaled(settings, bus)
    with first:
        with grpc.insecure_channel(first.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            _wait(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == devices, "devices")
            bus.lost_topics = {topics.placements, topics.tasks}
            answered = stub.Place(api.PlaceRequest(task=SPEC), timeout=5).placement
        assert answered.device_ids
        written = first.daemon.journal
        assert written is not None
        # The placement and the submission were in the file (write) or on disk (fsync) before the
        # answer; with write, the fsync followed.
        assert written.written >= 2
        if sync == "fsync":
            assert written.durable >= 2
        _wait(lambda: written.durable >= 2, "the journal's fsync")
    assert bus.read_all(topics.placements) == []  # the ledger topic never got the decision
    assert bus.read_all(topics.tasks) == []

    bus.lost_topics, bus.lost = set(), 0
    bus._committed.clear()  # a new process: its graph is rebuilt from the inputs' first records
    second = _journaled(settings, bus)
    with second, grpc.insecure_channel(second.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        kept = stub.GetPlacement(api.GetPlacementRequest(task_id=SPEC.id), timeout=5).placement
        assert kept == answered
        again = stub.Place(api.PlaceRequest(task=SPEC), timeout=5).placement
        assert again == answered
        ledger = [ev.Placement.FromString(r.value or b"") for r in bus.read_all(topics.placements)]
        assert ledger == [answered]  # published again, once
        # The submission was published again too: the graph holds the task on its devices.
        _wait(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).running_tasks == 1, "the task")
        journal = second.daemon.journal
        assert journal is not None
        _wait(lambda: len(journal) == 0, "the delivered records to leave the journal")
        # A later decision is numbered after the kept one.
        other = stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="later", memory_per_device_gb=1.0)), timeout=5)
        assert other.placement.sequence == answered.sequence + 1


@pytest.mark.parametrize(
    ("record", "where"),
    [(3, "payload"), (3, "header"), (11, "payload")],
    ids=["record 3, payload", "record 3, header", "the last placement, payload"],
)
def test_a_flipped_bit_in_one_journal_record_loses_that_record_only_and_no_sequence_repeats(
    tmp_path: Path, record: int, where: str
) -> None:
    settings = memory_settings(tmp_path)
    topics = settings.kafka.topics
    bus = LossyBus()
    devices = _publish_inventory(bus, settings)
    specs = [ev.TaskSpec(id=f"t{i}", memory_per_device_gb=4.0, workload_class="resnet50") for i in range(6)]
    first = _journaled(settings, bus)
    with first, grpc.insecure_channel(first.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        _wait(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == devices, "devices")
        bus.lost_topics = {topics.placements, topics.tasks}  # only the journal keeps them
        answered = [stub.Place(api.PlaceRequest(task=spec), timeout=5).placement for spec in specs]
    assert [p.sequence for p in answered] == [1, 2, 3, 4, 5, 6]
    # Twelve records: each Place's placement, then its submission. Flip one bit of one of them.
    path = settings.state_dir / JOURNAL_NAME
    data = bytearray(path.read_bytes())
    starts = record_starts(bytes(data))
    assert len(starts) == 12
    at = starts[record - 1] + (RECORD_HEADER_BYTES + 9 if where == "payload" else 6)
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    damaged = specs[(record - 1) // 2].id

    bus.lost_topics, bus.lost = set(), 0
    bus._committed.clear()  # a new process: its graph is rebuilt from the inputs' first records
    second = _journaled(settings, bus)
    with second, grpc.insecure_channel(second.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        # The 11 good records came back: every answered placement but the damaged one, and every submission.
        for placement in answered:
            if placement.task_id != damaged:
                got = stub.GetPlacement(api.GetPlacementRequest(task_id=placement.task_id), timeout=5)
                assert got.placement == placement
        assert sorted(ev.TaskEvent.FromString(r.value or b"").submitted.id for r in bus.read_all(topics.tasks)) == [
            s.id for s in specs
        ]
        # The damaged task's submission came back: it is placed again, numbered past everything seen.
        placed = api.GetPlacementRequest(task_id=damaged)
        _wait(lambda: has_placement(stub, damaged), "the damaged task placed again")
        again = stub.GetPlacement(placed, timeout=5).placement
        assert again.sequence > 6
        later = stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="later", memory_per_device_gb=1.0)), timeout=5)
        assert later.placement.sequence > again.sequence
        ledger = [ev.Placement.FromString(r.value or b"").sequence for r in bus.read_all(topics.placements)]
        assert len(ledger) == len(set(ledger)) == 7  # 5 restored, the damaged task's and the later one: none twice
        assert second.daemon.metrics.registry.get_sample_value("hlb_journal_records_skipped_total") == 1.0


def test_a_replay_says_how_long_the_rest_should_take_at_the_rate_seen_lately() -> None:
    progress = ReplayProgress()
    assert progress.describe(1000) == "1000 records left"  # nothing to tell a rate from yet
    progress.note(0.0, 1000)
    progress.note(10.0, 800)
    assert progress.describe(800) == "800 records left, about 40 s at 20 records/s"
    progress.note(40.0, 800)  # stalled: the window keeps its last 30 s, where nothing moved
    progress.note(45.0, 800)
    assert progress.describe(800) == "800 records left"
    long = ReplayProgress()
    long.note(0.0, 10_000_000)
    long.note(10.0, 9_990_000)
    assert long.describe(9_990_000) == "9990000 records left, about 2.8 h at 1,000 records/s"
