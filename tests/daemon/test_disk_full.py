"""A full disk is a state, not a failure mode: while the journal takes nothing the daemon says so
(NOT_SERVING, ``hlb_serving`` 0, ``hlb_journal_writable`` 0) and refuses decisions with
UNAVAILABLE, a decision caught by it is undone whole, snapshots clean up after themselves, each
episode is logged once, and the daemon serves again by itself when space returns."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Settings, Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.record.answers import JournaledPublisher
from hlb.daemon.record.journal import JOURNAL_NAME, JournalFile, decode_all
from hlb.daemon.record.snapshot import FileSnapshotStore
from hlb.daemon.record.statedump import canonical_state
from hlb.daemon.runtime import daemon as daemon_module
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.runtime.durability import WITHDRAWN_REASON, withdraw_decisions
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.daemon.background import wait_until as _wait
from tests.daemon.diskfull import DiskFull

CELL = "default"
REFUSED = "decisions refused: the decision journal cannot be written; tried again every second"
WORKS_AGAIN = "the decision journal is written again; deciding"


def _journaled(settings: Settings, bus: MemoryBus) -> BackgroundDaemon:
    running = BackgroundDaemon(settings, bus)
    running.daemon.journal_enabled = True  # on by default with Kafka only
    return running


def _publish_inventory(bus: MemoryBus, settings: Settings) -> int:
    events = inventory_events(CELL)
    for event in events:
        bus.publish(settings.kafka.topics.telemetry, CELL.encode(), event.SerializeToString())
    return sum(e.HasField("device_upsert") for e in events)


def _spec(task_id: str) -> ev.TaskSpec:
    return ev.TaskSpec(id=task_id, memory_per_device_gb=4.0, workload_class="resnet50", work_ref_s=60.0)


def _state(daemon: Daemon) -> dict[str, Any]:
    """The daemon's state, less the ledger's counter: a withdrawn placement's number is not given again."""
    with daemon.lock:
        state = canonical_state(daemon.scheduler)
    del state["ledger"]["last_sequence"]
    return state


def _health(channel: grpc.Channel) -> int:
    status: int = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    return status


def _placed(bus: MemoryBus, settings: Settings) -> list[ev.Placement]:
    return [ev.Placement.FromString(r.value or b"") for r in bus.read_all(settings.kafka.topics.placements)]


def _submitted(bus: MemoryBus, settings: Settings) -> list[str]:
    return [ev.TaskEvent.FromString(r.value or b"").submitted.id for r in bus.read_all(settings.kafka.topics.tasks)]


@pytest.mark.parametrize(("sync", "failing"), [("write", "write"), ("fsync", "write"), ("fsync", "fsync")])
def test_a_decision_the_journal_does_not_take_is_refused_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str, failing: str
) -> None:
    settings = memory_settings(tmp_path, sync)
    bus = MemoryBus()
    devices = _publish_inventory(bus, settings)
    disk = DiskFull(monkeypatch, settings.state_dir)
    first = _journaled(settings, bus)
    with first, grpc.insecure_channel(first.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        _wait(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == devices, "devices")
        kept = stub.Place(api.PlaceRequest(task=_spec("kept")), timeout=5).placement
        daemon = first.daemon
        journal = daemon.journal
        assert journal is not None
        _wait(lambda: journal.durable >= 2, "the journal's fsync")
        before = _state(daemon)
        on_disk = decode_all((settings.state_dir / JOURNAL_NAME).read_bytes())[0]
        if failing == "write":
            disk.full = True
        else:
            disk.fsync_fails = True  # the file takes the records, the disk does not keep them

        with pytest.raises(grpc.RpcError) as refused:
            stub.Place(api.PlaceRequest(task=_spec("refused")), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        details = refused.value.details() or ""
        assert "decisions cannot be made durable: the decision journal cannot be written" in details
        assert "No space left on device" in details
        assert "nothing was decided" in details
        # Nothing of it is left: no task, no reservation, no ledger entry, nothing for the broker
        # and nothing in the journal file.
        assert _state(daemon) == before
        with daemon.lock:
            assert daemon.ledger.get("refused") is None
        assert [p.task_id for p in _placed(bus, settings)] == ["kept"]
        assert _submitted(bus, settings) == ["kept"]
        assert decode_all((settings.state_dir / JOURNAL_NAME).read_bytes())[0] == on_disk
        # While the journal takes nothing, the daemon says so and decides nothing.
        assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        registry = daemon.metrics.registry
        assert registry.get_sample_value("hlb_serving") == 0.0
        assert registry.get_sample_value("hlb_journal_writable") == 0.0
        assert registry.get_sample_value("hlb_decisions_withdrawn_total", {"kind": "placement"}) == 1.0
        assert registry.get_sample_value("hlb_decisions_withdrawn_total", {"kind": "submission"}) == 1.0
        for call in (
            lambda: stub.Place(api.PlaceRequest(task=_spec("later")), timeout=5),
            lambda: stub.PlaceBatch(api.PlaceBatchRequest(tasks=[_spec("a"), _spec("b")]), timeout=5),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "refused until it can" in (refused.value.details() or "")
        assert _state(daemon) == before
    assert not [p.name for p in settings.state_dir.rglob("*tmp*")]
    disk.full = disk.fsync_fails = False
    _started_again_the_refused_task_is_unknown(settings, bus, kept)


def _started_again_the_refused_task_is_unknown(settings: Settings, bus: MemoryBus, kept: ev.Placement) -> None:
    """Stopped while the disk was full, started again with room: the refused task was never placed."""
    bus._committed.clear()  # a new process: its graph is rebuilt from the inputs' first records
    second = _journaled(settings, bus)
    with second, grpc.insecure_channel(second.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        assert stub.GetPlacement(api.GetPlacementRequest(task_id="kept"), timeout=5).placement == kept
        with pytest.raises(grpc.RpcError) as unknown:
            stub.GetPlacement(api.GetPlacementRequest(task_id="refused"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        again = stub.Place(api.PlaceRequest(task=_spec("refused")), timeout=5).placement
        assert again.sequence > kept.sequence
        assert [(p.task_id, p.sequence) for p in _placed(bus, settings)] == [
            ("kept", kept.sequence),
            ("refused", again.sequence),
        ]


def test_the_daemon_serves_again_by_itself_once_the_disk_takes_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon_module, "JOURNAL_PROBE_S", 0.1)  # tried every 0.1 s instead of every second
    settings = memory_settings(tmp_path)
    topics = settings.kafka.topics
    bus = MemoryBus()
    devices = _publish_inventory(bus, settings)
    disk = DiskFull(monkeypatch, settings.state_dir)
    running = _journaled(settings, bus)
    with running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        _wait(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == devices, "devices")
        assert stub.Place(api.PlaceRequest(task=_spec("before")), timeout=5).HasField("placement")
        registry = running.daemon.metrics.registry
        with capture_logs() as logs:
            started = time.monotonic()
            disk.full = True
            with pytest.raises(grpc.RpcError) as refused:
                stub.Place(api.PlaceRequest(task=_spec("during")), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # Submissions keep coming through Kafka: ingest queues them and decides nothing while
            # the journal takes nothing (what it decided would only be withdrawn again each try).
            for i in range(5):
                submitted = ev.TaskEvent(cell=CELL, submitted=_spec(f"kafka-{i}"))
                bus.publish(topics.tasks, CELL.encode(), submitted.SerializeToString())
            _wait(lambda: (registry.get_sample_value("hlb_journal_sync_failures_total") or 0) >= 8, "eight tries")
            _wait(lambda: running.daemon.scheduler.pending_count == 5, "the Kafka submissions queued")
            assert [p.task_id for p in _placed(bus, settings)] == ["before"]  # nothing reached the broker
            # Only the refused Place's decision was made and withdrawn; ingest made none to withdraw.
            assert registry.get_sample_value("hlb_decisions_withdrawn_total", {"kind": "placement"}) == 1
            assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING

            disk.full = False
            _wait(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING, "SERVING again")
            elapsed_s = time.monotonic() - started
            assert registry.get_sample_value("hlb_journal_writable") == 1.0
            assert registry.get_sample_value("hlb_serving") == 1.0
            during = stub.Place(api.PlaceRequest(task=_spec("during")), timeout=5).placement
            assert during.device_ids
            _wait(lambda: len(_placed(bus, settings)) == 7, "the Kafka submissions placed")
        events = Counter(entry["event"] for entry in logs)
        assert events[REFUSED] == 1
        assert events[WORKS_AGAIN] == 1
        lines = Counter(repr(sorted(entry.items())) for entry in logs)  # a line: its event and its fields
        repeated = {line: n for line, n in lines.items() if n > 1 + elapsed_s}
        assert not repeated, f"logged more than once a second over {elapsed_s:.1f} s: {repeated}"
        placed = _placed(bus, settings)
        assert sorted(p.task_id for p in placed) == sorted(["before", "during", *(f"kafka-{i}" for i in range(5))])
        sequences = [p.sequence for p in placed]
        assert sequences == sorted(set(sequences))  # each once, in order, none repeated


def test_snapshots_the_disk_does_not_take_are_logged_once_and_leave_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = memory_settings(tmp_path, snapshot={"interval_s": 0.05})
    directory = settings.state_dir / "snapshots"
    disk = DiskFull(monkeypatch, settings.state_dir)
    running = BackgroundDaemon(settings, MemoryBus())
    running.daemon.snapshots = FileSnapshotStore(directory, keep=2)  # on by default with Kafka only
    registry = running.daemon.metrics.registry
    with capture_logs() as logs, running:
        _wait(lambda: len(list(directory.glob("snapshot-*"))) == 1, "a snapshot")
        disk.full = True
        _wait(lambda: (registry.get_sample_value("hlb_snapshot_failures_total") or 0) >= 5, "five failed snapshots")
        assert not list(directory.glob(".*tmp"))
        assert running.daemon.serving  # snapshots are not what decisions wait for
        disk.full = False
        _wait(lambda: len(list(directory.glob("snapshot-*"))) == 2, "a snapshot again")
    events = Counter(entry["event"] for entry in logs)
    assert events["snapshot failed; tried again every snapshot.interval_s, logged again once one is written"] == 1
    assert events["snapshot written again"] == 1


def test_withdrawing_placements_gives_their_devices_back_and_queues_their_tasks_again(tmp_path: Path) -> None:
    ledger = PlacementLedger()
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), ledger, CELL, clock=lambda: 1000.0)
    for event in inventory_events(CELL):
        scheduler.apply_telemetry(event)
    journal = JournalFile.open(tmp_path)
    publisher = JournaledPublisher(journal=journal, inner=MemoryBus())
    topics = Topics(placements="p", tasks="t")
    ledger.subscribe(lambda p: publisher.publish("p", CELL.encode(), p.SerializeToString()))
    for i in range(3):  # submitted through Kafka: the bus has them, the journal need not
        scheduler.apply_task_event(ev.TaskEvent(cell=CELL, submitted=_spec(f"t{i}")))
    before = canonical_state(scheduler)
    assert len(scheduler.schedule_pending()) == 3
    # The journal does not take the three placements: undone, the state is as before them, but
    # for the ledger's counter (a number a watcher may have seen is not given again).
    undone = withdraw_decisions(scheduler, publisher.withdraw(), topics)
    assert (undone.placements, undone.submissions, undone.kept) == (["t0", "t1", "t2"], [], [])
    after = canonical_state(scheduler)
    assert after["ledger"] == {"placements": 0, "last_sequence": 3}
    before["ledger"] = after["ledger"]
    assert after == before
    assert {scheduler.graph.tasks[f"t{i}"].pending_reason for i in range(3)} == {WITHDRAWN_REASON}
    scheduler.reconsider()
    again = scheduler.schedule_pending()
    assert [(p.task_id, p.sequence) for p in again] == [("t0", 4), ("t1", 5), ("t2", 6)]
    journal.ticket()
    journal.write()

    # A task submitted through the API goes altogether, its placement too.
    state = canonical_state(scheduler)
    decision = scheduler.place(_spec("api"))
    assert decision.placement is not None
    publisher.publish("t", CELL.encode(), ev.TaskEvent(cell=CELL, submitted=_spec("api")).SerializeToString())
    undone = withdraw_decisions(scheduler, publisher.withdraw(), topics)
    assert (undone.placements, undone.submissions) == (["api"], ["api"])
    after = canonical_state(scheduler)
    state["ledger"] = after["ledger"]
    assert after == state
    assert "api" not in scheduler.graph.tasks
    journal.close()


def test_a_state_dump_the_disk_does_not_take_keeps_the_last_one_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlb.daemon.cells.host import CellHost, ShardRun
    from hlb.daemon.cells.shard import Shard
    from hlb.daemon.record.statedump import DUMP_NAME

    host = CellHost(memory_settings(tmp_path))
    shards = [Shard(host._shard_settings(host.settings, n), MemoryBus(), n) for n in range(2)]
    for shard in shards:
        host.shards[shard.shard] = ShardRun(shard.shard, daemon=shard)
    full = shards[0].settings.state_dir
    disk = DiskFull(monkeypatch, full)
    first = shards[0].dump_state()
    assert first == full / DUMP_NAME
    kept = first.read_text()
    disk.full = True
    with capture_logs() as logs:
        written = host.dump_state()
    assert written == [shards[1].settings.state_dir / DUMP_NAME]  # the other shard still wrote its dump
    assert sorted(p.name for p in full.iterdir()) == [DUMP_NAME]  # no partial file beside the last good one
    assert first.read_text() == kept
    (failure,) = [entry for entry in logs if entry["event"] == "state dump not written"]
    assert failure["shard"] == 0
    assert "No space left" in failure["error"]
