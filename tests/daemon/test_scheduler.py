"""The scheduling core with no I/O: feasibility, least-loaded choice, gangs, queue, lifecycle, replay."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.errors import InvalidEventError, UnknownTaskError
from daemon.graph import InfraGraph, TaskState
from daemon.ledger import PlacementLedger
from daemon.policy import LeastLoaded
from daemon.scheduler import Scheduler
from hlb.v1 import events_pb2 as ev

GPU, TPU = ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU


def device(device_id: str, host: str, kind: ev.DeviceKind.ValueType = GPU, memory_gb: float = 32) -> ev.TelemetryEvent:
    spec = ev.Device(id=device_id, host_id=host, kind=kind, model=f"m{int(memory_gb)}", memory_gb=memory_gb)
    return ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=spec)


def make_scheduler(ledger: PlacementLedger | None = None) -> Scheduler:
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), ledger or PlacementLedger(), "c", clock=lambda: 1000.0)
    for event in [
        device("g0", "h0"),
        device("g1", "h0"),
        device("big", "h1", memory_gb=80),
        device("tpu", "h2", kind=TPU, memory_gb=16),
    ]:
        scheduler.apply_telemetry(event)
    return scheduler


def submit(scheduler: Scheduler, spec: ev.TaskSpec) -> None:
    scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=spec))


def test_memory_and_kind_constraints_are_never_violated() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="large", memory_per_device_gb=60))
    submit(scheduler, ev.TaskSpec(id="tpu-job", memory_per_device_gb=8, allowed_kinds=[TPU]))
    placed = {p.task_id: list(p.device_ids) for p in scheduler.schedule_pending()}
    assert placed == {"large": ["big"], "tpu-job": ["tpu"]}


def test_least_loaded_prefers_the_idle_device() -> None:
    scheduler = make_scheduler()
    busy = ev.MetricsBatch(
        devices=[ev.DeviceMetrics(device_id=d, utilization=0.9) for d in ("g0", "big", "tpu")]
        + [ev.DeviceMetrics(device_id="g1", utilization=0.1)]
    )
    scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", metrics_batch=busy))
    decision = scheduler.place(ev.TaskSpec(id="t", memory_per_device_gb=4))
    assert decision.placement is not None
    assert list(decision.placement.device_ids) == ["g1"]


def test_a_gang_is_placed_all_or_nothing_on_distinct_devices() -> None:
    scheduler = make_scheduler()
    decision = scheduler.place(ev.TaskSpec(id="gang3", num_devices=3, memory_per_device_gb=20, allowed_kinds=[GPU]))
    assert decision.placement is not None
    assert sorted(decision.placement.device_ids) == ["big", "g0", "g1"]
    too_big = scheduler.place(ev.TaskSpec(id="gang4", num_devices=4, memory_per_device_gb=20, allowed_kinds=[GPU]))
    assert too_big.placement is None
    assert too_big.pending is not None
    assert "needs 4 devices" in too_big.pending.reason or "no feasible" in too_big.pending.reason
    # Nothing was reserved for the refused gang.
    assert scheduler.graph.devices.n_tasks.max() <= 1


def test_a_pending_task_is_placed_once_capacity_frees_up() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="first", memory_per_device_gb=70))
    submit(scheduler, ev.TaskSpec(id="second", memory_per_device_gb=70))
    assert [p.task_id for p in scheduler.schedule_pending()] == ["first"]
    pending = scheduler.lookup("second").pending
    assert pending is not None
    assert pending.queue_position == 1
    assert pending.reason == "no feasible device (4 ruled out by memory 4)"
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="first")))
    assert [p.task_id for p in scheduler.schedule_pending()] == ["second"]
    assert scheduler.graph.tasks["first"].state == TaskState.FINISHED


def test_higher_priority_goes_first_then_arrival_order() -> None:
    scheduler = make_scheduler()
    for task_id, priority in [("low", 0), ("high", 5), ("low2", 0)]:
        submit(scheduler, ev.TaskSpec(id=task_id, memory_per_device_gb=70, priority=priority))
    assert [scheduler.queue_position(t) for t in ("high", "low", "low2")] == [1, 2, 3]
    assert [p.task_id for p in scheduler.schedule_pending()] == ["high"]


def test_a_task_waits_for_its_dependencies_to_finish() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="prep"))
    submit(scheduler, ev.TaskSpec(id="train", dependencies=[ev.Dependency(task_id="prep", transfer_gb=2)]))
    assert [p.task_id for p in scheduler.schedule_pending()] == ["prep"]
    pending = scheduler.lookup("train").pending
    assert pending is not None
    assert "prep" in pending.reason
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="prep")))
    assert [p.task_id for p in scheduler.schedule_pending()] == ["train"]


def test_dry_run_changes_nothing() -> None:
    scheduler = make_scheduler()
    decision = scheduler.place(ev.TaskSpec(id="probe", memory_per_device_gb=8), dry_run=True)
    assert decision.placement is not None
    assert decision.placement.sequence == 0
    assert "probe" not in scheduler.graph.tasks
    assert len(scheduler.ledger) == 0
    assert not scheduler.graph.devices.reserved_gb.any()


def test_a_replayed_submission_binds_to_its_ledger_placement_instead_of_placing_again() -> None:
    first = make_scheduler()
    submit(first, ev.TaskSpec(id="t1", memory_per_device_gb=8))
    [placement] = first.schedule_pending()

    ledger = PlacementLedger()
    ledger.restore([placement])
    # The restarted daemon sees the task before the device it ran on: the binding waits for it.
    restarted = Scheduler(InfraGraph(), LeastLoaded(), ledger, "c", clock=lambda: 2000.0)
    submit(restarted, ev.TaskSpec(id="t1", memory_per_device_gb=8))
    for event in [device("g0", "h0"), device("g1", "h0"), device("big", "h1", memory_gb=80)]:
        restarted.apply_telemetry(event)
    assert restarted.schedule_pending() == []
    assert len(ledger) == 1
    assert restarted.graph.devices.reserved_gb[restarted.graph.devices.index[placement.device_ids[0]]] == 8


def test_replaying_the_same_events_twice_changes_nothing() -> None:
    scheduler = make_scheduler()
    spec = ev.TaskSpec(id="t", memory_per_device_gb=8)
    submit(scheduler, spec)
    scheduler.schedule_pending()
    submit(scheduler, spec)
    scheduler.apply_telemetry(device("g0", "h0"))
    assert scheduler.schedule_pending() == []
    assert len(scheduler.ledger) == 1


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (ev.TelemetryEvent(cell="c"), "empty"),
        (ev.TelemetryEvent(device_metrics=ev.DeviceMetrics(device_id="ghost")), "unknown_id"),
        (ev.TelemetryEvent(device_metrics=ev.DeviceMetrics(device_id="g0", utilization=1.5)), "out_of_range"),
        (ev.TelemetryEvent(device_upsert=ev.Device(id="x", host_id="h", kind=GPU, memory_gb=-1)), "out_of_range"),
        (ev.TelemetryEvent(device_upsert=ev.Device(id="", host_id="h", kind=GPU)), "missing_id"),
        (ev.TelemetryEvent(device_upsert=ev.Device(id="x", host_id="h")), "out_of_range"),  # kind unspecified
        (
            ev.TelemetryEvent(
                metrics_batch=ev.MetricsBatch(
                    devices=[ev.DeviceMetrics(device_id="g0", utilization=0.5), ev.DeviceMetrics(device_id="ghost")]
                )
            ),
            "unknown_id",
        ),
    ],
)
def test_bad_telemetry_is_refused_and_changes_nothing(event: ev.TelemetryEvent, reason: str) -> None:
    scheduler = make_scheduler()
    devices = scheduler.graph.devices
    before = (devices.utilization.copy(), devices.memory_gb.copy(), dict(devices.index))
    with pytest.raises(InvalidEventError) as refused:
        scheduler.apply_telemetry(event)
    assert refused.value.reason == reason
    after = (devices.utilization, devices.memory_gb, devices.index)
    assert all(np.array_equal(a, b) for a, b in zip(before[:2], after[:2], strict=True))
    assert after[2] == before[2]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (ev.TaskSpec(id=""), "missing_id"),
        (ev.TaskSpec(id="t", memory_per_device_gb=float("nan")), "out_of_range"),
        (ev.TaskSpec(id="t", num_devices=100_000), "out_of_range"),
        (ev.TaskSpec(id="t", dependencies=[ev.Dependency(task_id="t")]), "cycle"),
    ],
)
def test_bad_task_specs_are_refused(spec: ev.TaskSpec, reason: str) -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidEventError) as refused:
        submit(scheduler, spec)
    assert refused.value.reason == reason
    assert scheduler.graph.tasks == {}


def test_a_resubmission_with_a_different_spec_is_refused() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="t", memory_per_device_gb=1))
    with pytest.raises(InvalidEventError, match="another spec"):
        submit(scheduler, ev.TaskSpec(id="t", memory_per_device_gb=2))


def test_lifecycle_events_for_unknown_tasks_are_refused_and_lookups_say_not_found() -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidEventError) as refused:
        scheduler.apply_task_event(ev.TaskEvent(finished=ev.TaskFinished(task_id="ghost")))
    assert refused.value.reason == "unknown_id"
    with pytest.raises(UnknownTaskError):
        scheduler.lookup("ghost")


def test_a_device_running_tasks_cannot_be_removed() -> None:
    scheduler = make_scheduler()
    scheduler.place(ev.TaskSpec(id="t", memory_per_device_gb=70))
    with pytest.raises(InvalidEventError) as refused:
        scheduler.apply_telemetry(ev.TelemetryEvent(device_removed=ev.EntityRef(id="big")))
    assert refused.value.reason == "in_use"
    assert "big" in scheduler.graph.devices
