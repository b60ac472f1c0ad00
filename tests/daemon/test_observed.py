"""Device speeds corrected by the runs a scheduler sees (the rules-table control)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.observed import MAX_LOG_CORRECTION, ObservedSpeeds
from hlb.daemon.state.profiles import profiles_of
from hlb.v1 import events_pb2 as ev

MODEL = "V100-SXM2-16GB"


def two_devices() -> InfraGraph:
    graph = InfraGraph()
    for i in range(2):
        device = ev.Device(id=f"d{i}", host_id=f"h{i}", kind=ev.DEVICE_KIND_GPU, model=MODEL, memory_gb=16)
        graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    return graph


def spec(task_id: str, workload: str = "resnet50-bs64") -> ev.TaskSpec:
    return ev.TaskSpec(id=task_id, workload_class=workload, work_ref_s=1000.0, memory_per_device_gb=1.0)


def test_runs_slower_than_estimated_slow_the_estimates_of_their_family_and_of_their_device() -> None:
    graph, speeds = two_devices(), ObservedSpeeds(profiles_of("exact"))
    d0, d1 = np.array([0]), np.array([1])
    before = float(speeds.runtime_s(graph, d0, spec("a"))[0])
    for _ in range(40):  # every resnet50 run on d0 takes twice the estimate
        speeds.observe(spec("a"), graph, d0, 2 * before)
    assert speeds.version == 40
    assert float(speeds.runtime_s(graph, d0, spec("a"))[0]) == pytest.approx(2 * before, rel=0.05)
    # The slowdown is shared between the model's row and the device's own, so d1 (same model, never
    # seen) is estimated slower than profiled, but less slow than d0.
    on_d1 = float(speeds.runtime_s(graph, d1, spec("a"))[0])
    assert before < on_d1 < 2 * before
    assert float(speeds.runtime_s(graph, d0, spec("b", "lm-bs20"))[0]) > float(
        speeds.base.runtime_s(graph, d0, spec("b", "lm-bs20"))[0]
    )


def test_a_share_that_ran_as_long_as_its_share_says_corrects_nothing() -> None:
    """A task on a quarter of a shareable device runs four times its whole-device time: that is
    the profiles' estimate for it, not a slow device (the table once learned it as one)."""
    graph = InfraGraph()
    device = ev.Device(
        id="g0", host_id="h0", kind=ev.DEVICE_KIND_GPU, model=MODEL, memory_gb=16, sharing=ev.DEVICE_SHARING_MPS
    )
    graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    speeds, g0 = ObservedSpeeds(profiles_of("exact")), np.array([0])
    quarter = spec("q")
    quarter.device_share_milli = 250
    whole_s = float(speeds.base.runtime_s(graph, g0, quarter)[0])
    for _ in range(40):
        speeds.observe(quarter, graph, g0, 4 * whole_s)
    assert float(speeds.runtime_s(graph, g0, quarter)[0]) == pytest.approx(whole_s, rel=1e-6)
    for _ in range(40):  # twice its share's time: now the device is slow
        speeds.observe(quarter, graph, g0, 8 * whole_s)
    assert float(speeds.runtime_s(graph, g0, quarter)[0]) == pytest.approx(2 * whole_s, rel=0.05)


def test_a_correction_is_bounded_and_bad_runs_are_ignored() -> None:
    graph, speeds = two_devices(), ObservedSpeeds(profiles_of("exact"))
    d0 = np.array([0])
    for ran_s in (0.0, -5.0, math.inf, math.nan):
        speeds.observe(spec("a"), graph, d0, ran_s)
    assert speeds.version == 0
    for _ in range(500):
        speeds.observe(spec("a"), graph, d0, 1e-9)  # absurdly fast
    assert max(speeds.by_model.values()) <= MAX_LOG_CORRECTION
    assert max(speeds.by_device.values()) <= MAX_LOG_CORRECTION


def test_the_rules_table_preset_learns_from_the_runs_the_scheduler_sees_start_and_finish() -> None:
    now = [1000.0]
    policy = make_policy("rules-table")
    scheduler = Scheduler(two_devices(), policy, PlacementLedger(), "c", clock=lambda: now[0])
    speeds = policy.estimates
    assert isinstance(speeds, ObservedSpeeds)
    placement = scheduler.place(spec("t"))
    assert placement.placement is not None
    scheduler.apply_task_event(ev.TaskEvent(cell="c", started=ev.TaskStarted(task_id="t")))
    now[0] += 5000.0
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="t")))
    assert speeds.version == 1
    assert all(value < 0 for value in speeds.by_model.values())  # slower than the estimate of 1,000 s
    # A run that never started (cancelled while placed) teaches nothing.
    assert scheduler.place(spec("u")).placement is not None
    scheduler.apply_task_event(ev.TaskEvent(cell="c", cancelled=ev.EntityRef(id="u")))
    assert speeds.version == 1
