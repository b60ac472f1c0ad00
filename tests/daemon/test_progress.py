"""Task progress: the contract (protobuf and its JSON), its checks, and the scheduler expecting a
running task's end from its progress instead of its estimate."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from hlb.daemon.bus.codec import decode, to_json
from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import LimitsSettings, Topics
from hlb.daemon.decide.device_waits import remaining_s
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.ingest.pipeline import Ingestor, drain
from hlb.daemon.state.checks import check_bounds, check_task_progress
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.profiles import default_profiles
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev
from tests.daemon.clock import T0, Clock

REPO = Path(__file__).resolve().parents[2]
FAST, SLOW = "A100-SXM4-80GB", "V100-SXM2-32GB"


# -- the contract -----------------------------------------------------------------------------------


def test_a_progress_event_survives_the_wire_and_keeps_which_work_it_names() -> None:
    event = ev.TaskEvent(
        cell="c",
        event_time_ms=5,
        progress=ev.TaskProgress(task_id="t", fraction_done=0.0, rate_per_s=0.01, measured_at_ms=4),
    )
    again = ev.TaskEvent.FromString(event.SerializeToString())
    assert again == event
    assert again.WhichOneof("payload") == "progress"
    assert again.progress.WhichOneof("done") == "fraction_done"  # 0 done is a value, not "unset"
    by_work = ev.TaskProgress(task_id="t", work_done_ref_s=1800.0)
    assert ev.TaskProgress.FromString(by_work.SerializeToString()).WhichOneof("done") == "work_done_ref_s"


def test_the_json_mapping_of_a_progress_event() -> None:
    value = (
        b'{"cell": "c", "progress": {"task_id": "t", "fraction_done": 0.5, "rate_per_s": 0.001, "measured_at_ms": "7"}}'
    )
    event = decode(value, ev.TaskEvent, 1 << 20)
    assert event.progress == ev.TaskProgress(task_id="t", fraction_done=0.5, rate_per_s=0.001, measured_at_ms=7)
    camel = b'{"progress": {"taskId": "t", "workDoneRefS": 60, "measuredAtMs": 7}}'
    assert decode(camel, ev.TaskEvent, 1 << 20).progress == ev.TaskProgress(
        task_id="t", work_done_ref_s=60.0, measured_at_ms=7
    )
    assert json.loads(to_json(event)) == {
        "cell": "c",
        "progress": {"task_id": "t", "fraction_done": 0.5, "rate_per_s": 0.001, "measured_at_ms": "7"},
    }


def test_every_task_event_of_the_design_documents_json_parses() -> None:
    section = (REPO / "docs" / "design.md").read_text().split("### Task events in JSON", 1)[1]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None
    kinds = [decode(line.encode(), ev.TaskEvent, 1 << 20).WhichOneof("payload") for line in block[1].splitlines()]
    assert set(kinds) == {f.name for f in ev.TaskEvent.DESCRIPTOR.oneofs_by_name["payload"].fields}


# -- checks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("progress", "reason"),
    [
        (ev.TaskProgress(task_id="t"), "empty"),
        (ev.TaskProgress(fraction_done=0.5), "missing_id"),
        (ev.TaskProgress(task_id="t", fraction_done=1.5), "out_of_range"),
        (ev.TaskProgress(task_id="t", fraction_done=-0.1), "out_of_range"),
        (ev.TaskProgress(task_id="t", fraction_done=float("nan")), "out_of_range"),
        (ev.TaskProgress(task_id="t", work_done_ref_s=-1.0), "out_of_range"),
        (ev.TaskProgress(task_id="t", work_done_ref_s=float("inf")), "out_of_range"),
        (ev.TaskProgress(task_id="t", work_done_ref_s=2e10), "out_of_range"),
        (ev.TaskProgress(task_id="t", fraction_done=0.5, rate_per_s=-1.0), "out_of_range"),
        (ev.TaskProgress(task_id="t", fraction_done=0.5, rate_per_s=float("nan")), "out_of_range"),
        (ev.TaskProgress(task_id="t", fraction_done=0.5, measured_at_ms=-1), "out_of_range"),
    ],
)
def test_a_bad_progress_is_refused_with_its_reason(progress: ev.TaskProgress, reason: str) -> None:
    with pytest.raises(InvalidEventError) as refused:
        check_task_progress(progress)
    assert refused.value.reason == reason


def test_progress_at_its_bounds_is_valid_and_its_id_is_bounded_as_every_id() -> None:
    for progress in (
        ev.TaskProgress(task_id="t", fraction_done=0.0),
        ev.TaskProgress(task_id="t", fraction_done=1.0, rate_per_s=0.0),
        ev.TaskProgress(task_id="t", work_done_ref_s=1e10, rate_per_s=1e9, measured_at_ms=1),
    ):
        check_task_progress(progress)
    limits = LimitsSettings()
    long_id = ev.TaskEvent(progress=ev.TaskProgress(task_id="x" * (limits.id_bytes + 1), fraction_done=0.5))
    with pytest.raises(InvalidEventError, match=r"progress\.task_id") as refused:
        check_bounds(long_id, limits)
    assert refused.value.reason == "invalid_id"


# -- what is left, from a report --------------------------------------------------------------------


def test_the_run_time_left_follows_the_rate_or_else_the_pace_kept() -> None:
    half = ev.TaskProgress(task_id="t", fraction_done=0.5)
    assert remaining_s(half, 1000.0, elapsed_s=100.0) == pytest.approx(100.0)
    assert remaining_s(ev.TaskProgress(task_id="t", fraction_done=0.25, rate_per_s=0.001), 0.0, 100.0) == 750.0
    by_work = ev.TaskProgress(task_id="t", work_done_ref_s=300.0)
    assert remaining_s(by_work, 1200.0, elapsed_s=100.0) == pytest.approx(300.0)  # a quarter of 1,200 in 100 s
    assert remaining_s(ev.TaskProgress(task_id="t", work_done_ref_s=300.0, rate_per_s=2.0), 1200.0, 100.0) == 450.0
    assert remaining_s(ev.TaskProgress(task_id="t", fraction_done=1.0), 1000.0, 100.0) == 0.0
    assert remaining_s(ev.TaskProgress(task_id="t", work_done_ref_s=1500.0), 1200.0, 100.0) == 0.0  # overran
    assert remaining_s(ev.TaskProgress(task_id="t", fraction_done=0.0), 1000.0, 100.0) is None  # nothing done yet
    assert remaining_s(half, 1000.0, elapsed_s=0.0) is None  # its start is not known
    assert remaining_s(by_work, 0.0, elapsed_s=100.0) is None  # reference seconds of no estimate


# -- the scheduler ----------------------------------------------------------------------------------


def upsert(model: str) -> ev.TelemetryEvent:
    device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
    return ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device)


def work_for(model: str, runtime_s: float) -> float:
    """The work (reference-device s) of a resnet50 task that the profiles expect to run ``runtime_s`` on ``model``."""
    graph = InfraGraph()
    graph.apply_telemetry(upsert(model))
    spec = ev.TaskSpec(id="probe", workload_class="resnet50", work_ref_s=3600.0, memory_per_device_gb=4)
    return runtime_s * 3600.0 / float(default_profiles().runtime_s(graph, np.array([0]), spec)[0])


def make_scheduler(clock: Clock, policy: str = "rules", models: tuple[str, ...] = (FAST,)) -> Scheduler:
    scheduler = Scheduler(InfraGraph(), make_policy(policy), PlacementLedger(), "c", clock=clock)
    for model in models:
        scheduler.apply_telemetry(upsert(model))
    return scheduler


def submit(scheduler: Scheduler, task_id: str, work_ref_s: float) -> None:
    spec = ev.TaskSpec(id=task_id, workload_class="resnet50", work_ref_s=work_ref_s, memory_per_device_gb=4)
    scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=spec))


def start(scheduler: Scheduler, task_id: str) -> None:
    placement = scheduler.ledger.get(task_id)
    assert placement is not None
    started = ev.TaskStarted(task_id=task_id, device_ids=placement.device_ids)
    scheduler.apply_task_event(ev.TaskEvent(cell="c", started=started))


def report(scheduler: Scheduler, task_id: str, time_s: float | None = None, **progress: float) -> None:
    event_time_ms = int((scheduler.clock() if time_s is None else time_s) * 1000)
    payload = ev.TaskProgress(task_id=task_id, **progress)  # type: ignore[arg-type]
    scheduler.apply_task_event(ev.TaskEvent(cell="c", event_time_ms=event_time_ms, progress=payload))


def free_at_s(scheduler: Scheduler, model: str = FAST) -> float:
    return float(scheduler.graph.devices.free_at_ms[scheduler.graph.devices.index[model]]) / 1000.0


def running(clock: Clock, estimate_s: float = 1000.0, policy: str = "rules") -> Scheduler:
    """A scheduler whose task "t", estimated to run ``estimate_s`` on the fast device, started at T0."""
    scheduler = make_scheduler(clock, policy)
    submit(scheduler, "t", work_for(FAST, estimate_s))
    assert [p.task_id for p in scheduler.schedule_pending()] == ["t"]
    start(scheduler, "t")
    return scheduler


def test_a_task_half_done_after_100_s_is_expected_to_end_100_s_later_not_at_its_estimate() -> None:
    clock = Clock()
    scheduler = running(clock)
    assert free_at_s(scheduler) == pytest.approx(T0 + 1000.0, abs=0.002)  # the estimate, from its start
    clock.t += 100.0
    report(scheduler, "t", fraction_done=0.5)
    assert free_at_s(scheduler) == pytest.approx(T0 + 200.0, abs=0.002)
    assert scheduler.device_waits.expected_end == {"t": int((T0 + 200.0) * 1000)}
    clock.t += 100.0  # slower since: 60% after 200 s, at 0.2% a second now
    report(scheduler, "t", fraction_done=0.6, rate_per_s=0.002)
    assert free_at_s(scheduler) == pytest.approx(T0 + 400.0, abs=0.002)
    assert scheduler.graph.tasks["t"].state == TaskState.RUNNING


def test_the_end_counts_from_when_progress_was_measured_never_from_ahead_of_the_clock() -> None:
    clock = Clock()
    scheduler = running(clock)
    clock.t += 150.0
    report(scheduler, "t", fraction_done=0.5, measured_at_ms=int((T0 + 100.0) * 1000))  # measured 50 s ago
    assert free_at_s(scheduler) == pytest.approx(T0 + 200.0, abs=0.002)
    report(scheduler, "t", time_s=T0 + 100.0, fraction_done=0.5)  # no measured time: the event's
    assert free_at_s(scheduler) == pytest.approx(T0 + 200.0, abs=0.002)
    report(scheduler, "t", time_s=T0 + 900.0, fraction_done=0.75)  # from the future: taken as now
    assert free_at_s(scheduler) == pytest.approx(T0 + 150.0 + 50.0, abs=0.002)


def test_progress_in_reference_seconds_is_a_share_of_the_tasks_estimate() -> None:
    clock = Clock()
    scheduler = running(clock)
    work = scheduler.graph.tasks["t"].spec.work_ref_s
    clock.t += 300.0
    report(scheduler, "t", work_done_ref_s=work / 4)  # a quarter in 300 s: 900 s to go
    assert free_at_s(scheduler) == pytest.approx(T0 + 1200.0, abs=0.002)


def test_a_report_that_says_nothing_of_the_end_leaves_the_estimate() -> None:
    clock = Clock()
    scheduler = running(clock)
    clock.t += 100.0
    report(scheduler, "t", fraction_done=0.0)
    assert free_at_s(scheduler) == pytest.approx(T0 + 1000.0, abs=0.002)


def test_a_task_that_says_it_never_ends_no_longer_counts_on_its_device() -> None:
    clock = Clock()
    scheduler = running(clock)
    report(scheduler, "t", fraction_done=0.0, rate_per_s=1e-15)
    assert free_at_s(scheduler) == 0.0
    assert scheduler.device_waits.expected_end == {}


def test_waiting_tasks_are_decided_afresh_when_progress_moves_the_end_they_wait_for() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, models=(FAST, SLOW))
    submit(scheduler, "busy", work_for(FAST, 1000.0))
    scheduler.schedule_pending()
    assert scheduler.ledger.get("busy").device_ids == [FAST]  # type: ignore[union-attr]
    start(scheduler, "busy")
    submit(scheduler, "x", 3600.0)  # 1,000 + 1,470 s on the fast device against 3,600 s on the slow one
    assert scheduler.schedule_pending() == []
    assert scheduler.waiting_count == 1
    clock.t += 100.0
    report(scheduler, "busy", fraction_done=0.5)  # sooner: x keeps waiting, nothing to place
    assert scheduler.schedule_pending() == []
    assert scheduler.waiting_count == 1
    report(scheduler, "busy", fraction_done=0.01)  # 99% left at 1% in 100 s: free in 9,900 s
    placed = scheduler.schedule_pending()
    assert [(p.task_id, list(p.device_ids)) for p in placed] == [("x", [SLOW])]
    assert scheduler.waiting_count == 0


def test_progress_of_an_ended_forgotten_or_unstarted_task_changes_nothing() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    submit(scheduler, "placed", work_for(FAST, 1000.0))
    scheduler.schedule_pending()
    report(scheduler, "placed", fraction_done=0.5)  # not started yet: its start is still to come
    assert free_at_s(scheduler) == pytest.approx(T0 + 1000.0, abs=0.002)
    start(scheduler, "placed")
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="placed")))
    report(scheduler, "placed", fraction_done=0.5)  # late: it has finished
    assert free_at_s(scheduler) == 0.0
    assert scheduler.device_waits.expected_end == {}
    scheduler.keep_ended_s = 1.0
    assert scheduler.forget_ended(clock.t + 1.0) == 1
    report(scheduler, "placed", fraction_done=0.5)  # later still: it is forgotten
    assert scheduler.device_waits.expected_end == {}


def test_progress_of_an_unknown_or_never_placed_task_is_refused() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, models=())
    with pytest.raises(InvalidEventError) as unknown:
        report(scheduler, "nobody", fraction_done=0.5)
    assert unknown.value.reason == "unknown_id"
    submit(scheduler, "queued", 100.0)  # no device: it stays queued
    with pytest.raises(InvalidEventError) as never_placed:
        report(scheduler, "queued", fraction_done=0.5)
    assert never_placed.value.reason == "inconsistent"
    with pytest.raises(InvalidEventError) as bad:
        report(scheduler, "queued", fraction_done=2.0)
    assert bad.value.reason == "out_of_range"


def test_a_policy_that_never_waits_keeps_no_expected_end() -> None:
    clock = Clock()
    scheduler = running(clock, policy="hetero-greedy")
    clock.t += 100.0
    report(scheduler, "t", fraction_done=0.5)
    assert scheduler.device_waits.expected_end == {}
    assert free_at_s(scheduler) == 0.0


def test_progress_through_ingest_is_applied_and_bad_progress_dead_lettered() -> None:
    topics = Topics()
    bus = MemoryBus()
    clock = Clock()
    scheduler = running(clock)
    ingestor = Ingestor(
        bus.source([topics.telemetry, topics.tasks], "g"), bus, scheduler, threading.RLock(), topics, 4096
    )
    clock.t += 100.0
    now_ms = int(clock.t * 1000)
    for value in (
        b'{"cell": "c", "event_time_ms": %d, "progress": {"task_id": "t", "fraction_done": 0.5}}' % now_ms,
        b'{"cell": "c", "progress": {"task_id": "t", "fraction_done": 1.5}}',
        b'{"cell": "c", "progress": {"task_id": "nobody", "fraction_done": 0.5}}',
        b'{"cell": "c", "progress": {"task_id": "t"}}',
    ):
        bus.publish(topics.tasks, b"c", value)
    assert drain(ingestor) == 4
    assert ingestor.stats.applied == 1
    assert dict(ingestor.stats.rejected) == {"out_of_range": 1, "unknown_id": 1, "empty": 1}
    reasons = [dict(r.headers)["hlb.error.reason"] for r in bus.read_all(topics.dlq)]
    assert reasons == [b"out_of_range", b"unknown_id", b"empty"]
    assert free_at_s(scheduler) == pytest.approx(T0 + 200.0, abs=0.002)
