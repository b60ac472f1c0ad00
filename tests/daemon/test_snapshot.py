"""Snapshots: a round trip gives the same state; untrustworthy snapshots are skipped; restoring and
replaying from the snapshot's offsets ends where an uninterrupted run does."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.ingest.pipeline import Ingestor, drain
from hlb.daemon.record import snapshot as snap
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev
from tests.daemon.diskfull import DiskFull

TOPICS = Topics()
GPU = ev.DEVICE_KIND_GPU


def telemetry(**payload: object) -> bytes:
    return ev.TelemetryEvent(cell="c", event_time_ms=1000, **payload).SerializeToString()  # type: ignore[arg-type]


def submitted(task_id: str, memory_gb: float = 4.0, deps: tuple[str, ...] = ()) -> bytes:
    spec = ev.TaskSpec(
        id=task_id, memory_per_device_gb=memory_gb, dependencies=[ev.Dependency(task_id=d) for d in deps]
    )
    return ev.TaskEvent(cell="c", submitted=spec).SerializeToString()


def history() -> list[tuple[str, bytes]]:
    """Inventory, metrics, removals (so rows are reused from the free list) and task lifecycles."""
    events: list[tuple[str, bytes]] = [(TOPICS.telemetry, telemetry(switch_upsert=ev.Switch(id="rack0")))]
    events += [(TOPICS.telemetry, telemetry(host_upsert=ev.Host(id=f"h{h}", rack_id="rack0"))) for h in range(2)]
    for i in range(6):
        device = ev.Device(id=f"d{i}", host_id=f"h{i % 2}", kind=GPU, model="V100" if i % 2 else "A100", memory_gb=32)
        events.append((TOPICS.telemetry, telemetry(device_upsert=device)))
    events.append((TOPICS.telemetry, telemetry(link_upsert=ev.Link(id="l0", src_id="h0", dst_id="rack0"))))
    events.append((TOPICS.telemetry, telemetry(device_removed=ev.EntityRef(id="d2"))))
    events += [(TOPICS.tasks, submitted(f"t{i}", 8.0)) for i in range(4)]
    events.append((TOPICS.tasks, submitted("after", 4.0, deps=("t0",))))
    events.append((TOPICS.tasks, submitted("huge", 1000.0)))  # stays pending
    batch = ev.MetricsBatch(devices=[ev.DeviceMetrics(device_id=f"d{i}", utilization=0.1 * i) for i in (0, 1, 3)])
    events.append((TOPICS.telemetry, telemetry(metrics_batch=batch)))
    events.append((TOPICS.tasks, ev.TaskEvent(finished=ev.TaskFinished(task_id="t0")).SerializeToString()))
    device = ev.Device(id="d9", host_id="h1", kind=GPU, model="T4", memory_gb=16)
    events.append((TOPICS.telemetry, telemetry(device_upsert=device)))  # takes d2's freed row
    events.append((TOPICS.tasks, submitted("late", 2.0)))
    return events


def make(bus: MemoryBus, ledger: PlacementLedger | None = None, start: snap.Offsets | None = None) -> Ingestor:
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), ledger or PlacementLedger(), "c", clock=lambda: 5.0)
    source = bus.source([TOPICS.telemetry, TOPICS.tasks], "g", start)
    ingestor = Ingestor(source, bus, scheduler, threading.RLock(), TOPICS, 1 << 20, clock=lambda: 2.0)
    ingestor.mirror_inventory = False
    return ingestor


def comparable(scheduler: Scheduler) -> dict[str, bytes]:
    """The state as bytes per array, without counters that depend on how events were batched."""
    arrays = snap.state_arrays(scheduler, {})
    arrays["graph.counters"] = arrays["graph.counters"][:1]  # newest telemetry time only
    # The last "why pending" of a task placed since: a restored run binds it to its ledger
    # placement without trying it first. Pending tasks' reasons are compared by the caller.
    del arrays["tasks.reason.blob"], arrays["tasks.reason.len"]
    return {k: v.tobytes() + str(v.dtype).encode() for k, v in arrays.items()}


def drained() -> Ingestor:
    """An ingestor that has applied the whole history, four records per batch."""
    bus = MemoryBus()
    for topic, value in history():
        bus.publish(topic, b"c", value)
    ingestor = make(bus)
    drain(ingestor, batch_size=4)
    return ingestor


def test_a_round_trip_restores_the_same_state() -> None:
    ingestor = drained()
    scheduler = ingestor.scheduler
    assert scheduler.pending_count == 1
    assert len(scheduler.graph.devices) == 6

    store = snap.MemorySnapshotStore()
    snap.take(store, scheduler, ingestor.positions, ingestor.lock)
    restored = snap.restore_newest(store)
    assert restored is not None
    state = restored[1]
    assert state.offsets == {(TOPICS.telemetry, 0): 13, (TOPICS.tasks, 0): 8}
    fresh = Scheduler(InfraGraph(max_tasks_per_device=4), LeastLoaded(), scheduler.ledger, "c", clock=lambda: 5.0)
    snap.install(state, fresh)
    assert fresh.graph.max_tasks_per_device == 4  # the running configuration, not the snapshot's
    fresh.graph.max_tasks_per_device = scheduler.graph.max_tasks_per_device
    assert snap.state_arrays(fresh, {}).keys() == snap.state_arrays(scheduler, {}).keys()
    assert comparable(fresh) == comparable(scheduler)
    g = fresh.graph
    assert g.devices.row("d9") == scheduler.graph.devices.row("d9")  # the free list came back too
    assert g.tasks_on_device(g.devices.index["d1"]) == scheduler.graph.tasks_on_device(g.devices.index["d1"])
    assert len(g.feasible_rows(ev.TaskSpec(id="x", memory_per_device_gb=1))) == len(
        scheduler.graph.feasible_rows(ev.TaskSpec(id="x", memory_per_device_gb=1))
    )
    assert fresh.queue_position("huge") == 1


def test_a_snapshot_from_before_the_task_feature_columns_fills_them_from_the_tasks() -> None:
    scheduler = drained().scheduler
    arrays = snap.state_arrays(scheduler, {})
    for column in scheduler.graph.task_table.LATER_COLUMNS:
        del arrays[f"task_table.col.{column}"]
    state = snap.restore_state(arrays)
    fresh = Scheduler(InfraGraph(), LeastLoaded(), scheduler.ledger, "c", clock=lambda: 5.0)
    snap.install(state, fresh)
    assert comparable(fresh) == comparable(scheduler)
    assert int(fresh.graph.task_table.held.sum()) > 0  # some tasks hold devices: the columns say which


def test_restart_from_a_snapshot_and_replay_equals_an_uninterrupted_run() -> None:
    # One record per batch: the scheduler then decides at the same moments in every run.
    events = history()
    whole = MemoryBus()
    for topic, value in events:
        whole.publish(topic, b"c", value)
    uninterrupted = make(whole)
    drain(uninterrupted, batch_size=1)

    bus = MemoryBus()
    for topic, value in events:
        bus.publish(topic, b"c", value)
    first = make(bus)
    store = snap.MemorySnapshotStore()
    for _ in range(15):
        first.run_once(1, 0.0)
    snap.take(store, first.scheduler, first.positions, first.lock)
    for _ in range(5):  # applied but not in the snapshot: replayed after the restart
        first.run_once(1, 0.0)

    restored = snap.restore_newest(store)
    assert restored is not None
    ledger = PlacementLedger()
    ledger.restore(first.scheduler.ledger.since(1))  # as read back from the ledger topic
    second = make(bus, ledger, start=restored[1].offsets)
    snap.install(restored[1], second.scheduler)
    drain(second, batch_size=1)
    assert comparable(second.scheduler) == comparable(uninterrupted.scheduler)
    pending = [t for t in uninterrupted.scheduler.graph.tasks if uninterrupted.scheduler.queue_position(t)]
    assert pending == ["huge"]
    assert second.scheduler.lookup("huge") == uninterrupted.scheduler.lookup("huge")
    assert [p.task_id for p in second.scheduler.ledger.since(1)] == [
        p.task_id for p in uninterrupted.scheduler.ledger.since(1)
    ]


def test_a_replayed_batch_changes_nothing() -> None:
    bus = MemoryBus()
    for topic, value in history():
        bus.publish(topic, b"c", value)
    ingestor = make(bus)
    drain(ingestor, batch_size=4)
    before = comparable(ingestor.scheduler)
    ingestor.apply_batch(bus.read_all(TOPICS.telemetry)[-3:] + bus.read_all(TOPICS.tasks)[-3:])
    ingestor.scheduler.schedule_pending()
    assert comparable(ingestor.scheduler) == before


def test_a_snapshot_from_before_a_column_was_added_restores_it_at_its_default() -> None:
    ingestor = drained()
    arrays = snap.state_arrays(ingestor.scheduler, ingestor.positions)
    del arrays["devices.col.free_at_ms"]
    state = snap.restore_state(snap.decode(snap.encode(arrays)))
    d = state.graph.devices
    assert d.free_at_ms.dtype == np.int64
    assert d.free_at_ms.shape == d.alive.shape
    assert not d.free_at_ms.any()
    assert len(d) == 6


def _valid_snapshot() -> bytes:
    bus = MemoryBus()
    for topic, value in history():
        bus.publish(topic, b"c", value)
    ingestor = make(bus)
    drain(ingestor, batch_size=4)
    return snap.encode(snap.state_arrays(ingestor.scheduler, ingestor.positions))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _inconsistent() -> bytes:
    arrays = snap.decode(_valid_snapshot())
    arrays["devices.alive"] = arrays["devices.alive"][:-1]  # a column of another length
    return snap.encode(arrays)


@pytest.mark.parametrize(
    ("corrupt", "why"),
    [
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: d[:10], "truncated"),
        (lambda d: b"NOTSNAP!" + d[8:], "bad magic"),
        (lambda d: d[:8] + (99).to_bytes(4, "little") + d[12:], "format version"),
        (lambda d: _flip(d, len(d) - 100), "checksum"),
        (lambda d: _inconsistent(), "ids for"),
    ],
)
def test_an_untrustworthy_snapshot_is_reported_and_the_older_one_used(
    tmp_path: Path, corrupt: object, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = snap.FileSnapshotStore(tmp_path, keep=3)
    good = _valid_snapshot()
    older = store.save(good)
    newer = store.save(corrupt(good))  # type: ignore[operator]
    assert store.names() == [newer, older]
    with pytest.raises(snap.SnapshotError, match=why):
        snap.restore_state(snap.decode(store.load(newer)))
    restored = snap.restore_newest(store)
    assert restored is not None
    assert restored[0] == older
    assert "snapshot skipped" in capsys.readouterr().out


def test_no_trustworthy_snapshot_means_none(tmp_path: Path) -> None:
    store = snap.FileSnapshotStore(tmp_path / "state")
    assert snap.restore_newest(store) is None
    store.save(b"garbage")
    assert snap.restore_newest(store) is None


def test_the_file_store_writes_atomically_and_keeps_the_newest(tmp_path: Path) -> None:
    store = snap.FileSnapshotStore(tmp_path, keep=2)
    names = [store.save(bytes([i]) * 10) for i in range(4)]
    assert store.names() == [names[3], names[2]]
    assert store.load(names[3]) == bytes([3]) * 10
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_snapshot_the_disk_does_not_take_leaves_no_file_and_the_older_ones_stand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = snap.FileSnapshotStore(tmp_path, keep=2)
    first = store.save(b"first")
    disk = DiskFull(monkeypatch, tmp_path)
    disk.full = True
    for _ in range(3):
        with pytest.raises(OSError, match="No space left on device"):
            store.save(b"x" * 100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first]  # no temporary file left behind
    disk.full = False
    disk.fsync_fails = True  # written, but the disk does not keep it
    with pytest.raises(OSError, match="No space left on device"):
        store.save(b"second")
    assert sorted(p.name for p in tmp_path.iterdir()) == [first]
    disk.fsync_fails = False
    assert store.save(b"second") == "snapshot-000000000002.hlbsnap"
    assert [store.load(name) for name in store.names()] == [b"second", b"first"]


def test_a_temporary_file_a_killed_daemon_left_is_removed_when_the_store_is_made(tmp_path: Path) -> None:
    store = snap.FileSnapshotStore(tmp_path)
    name = store.save(b"kept")
    (tmp_path / ".snapshot-000000000002.hlbsnap.tmp").write_bytes(b"half a snapshot")
    (tmp_path / "notes.tmp").write_bytes(b"not the store's")
    snap.FileSnapshotStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", name]


def test_strings_pack_and_unpack() -> None:
    items = [b"a", None, b"", "é".encode()]
    blob, lengths = snap.pack_bytes(items)
    assert snap.unpack_bytes(blob, lengths) == items
    with pytest.raises(snap.SnapshotError):
        snap.unpack_bytes(blob, np.array([5, -1, 0, 2]))
