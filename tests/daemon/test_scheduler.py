"""The scheduling core with no I/O: feasibility, least-loaded choice, gangs, queue, lifecycle, replay."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlb.daemon.decide.presets import POLICY_NAMES, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.errors import InvalidEventError, UnknownTaskError
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

GPU, TPU = ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU


def device(device_id: str, host: str, kind: ev.DeviceKind.ValueType = GPU, memory_gb: float = 32) -> ev.TelemetryEvent:
    spec = ev.Device(id=device_id, host_id=host, kind=kind, model=f"m{int(memory_gb)}", memory_gb=memory_gb)
    return ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=spec)


def make_scheduler(ledger: PlacementLedger | None = None, max_tasks_per_device: int = 1) -> Scheduler:
    graph = InfraGraph(max_tasks_per_device)
    scheduler = Scheduler(graph, LeastLoaded(), ledger or PlacementLedger(), "c", clock=lambda: 1000.0)
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
    assert pending.reason == "no feasible device (4 ruled out by memory 3, capacity 1)"
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
        (ev.TelemetryEvent(link_upsert=ev.Link(id="l", src_id="g0", dst_id="g1", kind=1000)), "out_of_range"),  # type: ignore[arg-type]
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
        (ev.TaskSpec(id="t", kind=-186), "out_of_range"),  # type: ignore[arg-type]  # open enum: any int32
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


# -- the loop, batches, scores and explanations ----------------------------------------------


def test_a_pass_with_nothing_new_does_no_work() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="huge", memory_per_device_gb=500))
    assert scheduler.schedule_pending() == []
    scheduler.graph.devices.memory_gb[:] = 1000.0  # behind the scheduler's back: no event, no pass
    assert scheduler.schedule_pending() == []
    scheduler.apply_telemetry(device("g9", "h9", memory_gb=1000))  # an inventory change: a pass
    assert [p.task_id for p in scheduler.schedule_pending()] == ["huge"]


def test_memory_used_by_others_and_by_tasks_not_started_yet_both_count() -> None:
    scheduler = make_scheduler(max_tasks_per_device=2)
    used = ev.DeviceMetrics(device_id="big", memory_used_gb=30)  # 30 of 80 GB used by something else
    scheduler.apply_telemetry(ev.TelemetryEvent(device_metrics=used))
    first = scheduler.place(ev.TaskSpec(id="first", memory_per_device_gb=40))
    assert first.placement is not None
    assert list(first.placement.device_ids) == ["big"]
    # 30 used + 40 placed (not started, so not in the report yet) leaves 10 GB, not 40.
    second = ev.TaskSpec(id="second", memory_per_device_gb=20, allowed_models=["m80"])  # only "big" is m80
    assert scheduler.place(second).pending is not None
    scheduler.apply_task_event(ev.TaskEvent(started=ev.TaskStarted(task_id="first")))
    report = ev.DeviceMetrics(device_id="big", memory_used_gb=70)  # now the report includes it
    scheduler.apply_telemetry(ev.TelemetryEvent(device_metrics=report))
    assert scheduler.schedule_pending() == []
    scheduler.apply_telemetry(ev.TelemetryEvent(device_metrics=ev.DeviceMetrics(device_id="big", memory_used_gb=50)))
    assert [p.task_id for p in scheduler.schedule_pending()] == ["second"]  # it used less than it reserved


def test_a_task_skipped_behind_a_smaller_one_of_its_shape_still_says_why() -> None:
    scheduler = make_scheduler()
    for task_id, memory in (("big", 500.0), ("bigger", 600.0)):
        submit(scheduler, ev.TaskSpec(id=task_id, memory_per_device_gb=memory))
    scheduler.schedule_pending()
    for task_id in ("big", "bigger"):
        pending = scheduler.lookup(task_id).pending
        assert pending is not None
        assert pending.reason.startswith("no feasible device")


def test_a_dependency_that_failed_says_the_task_can_never_start() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="prep"))
    submit(scheduler, ev.TaskSpec(id="train", dependencies=[ev.Dependency(task_id="prep")]))
    scheduler.schedule_pending()
    scheduler.apply_task_event(ev.TaskEvent(failed=ev.TaskFailed(task_id="prep", reason="oom")))
    scheduler.schedule_pending()
    pending = scheduler.lookup("train").pending
    assert pending is not None
    assert "prep, which is failed" in pending.reason


def test_a_batch_is_placed_jointly_by_priority_and_answered_in_request_order() -> None:
    scheduler = make_scheduler()
    specs = [
        ev.TaskSpec(id="low", memory_per_device_gb=70),
        ev.TaskSpec(id="high", memory_per_device_gb=70, priority=9),
    ]
    low, high = scheduler.place_batch(specs)
    assert high.placement is not None
    assert list(high.placement.device_ids) == ["big"]
    assert low.pending is not None
    assert low.pending.queue_position == 1


def test_a_dry_run_batch_sees_its_own_reservations_and_leaves_nothing_behind() -> None:
    scheduler = make_scheduler(max_tasks_per_device=2)
    specs = [ev.TaskSpec(id=f"t{i}", memory_per_device_gb=30, allowed_kinds=[GPU]) for i in range(4)]
    decisions = scheduler.place_batch(specs, dry_run=True)
    placed = [d.placement.device_ids[0] for d in decisions if d.placement is not None]
    assert sorted(placed) == ["big", "big", "g0", "g1"]
    assert not scheduler.graph.devices.reserved_gb.any()
    assert not scheduler.graph.devices.n_tasks.any()
    assert scheduler.graph.tasks == {}
    assert len(scheduler.ledger) == 0


def test_a_batch_with_a_bad_or_repeated_spec_changes_nothing() -> None:
    scheduler = make_scheduler()
    for batch in ([ev.TaskSpec(id="ok"), ev.TaskSpec(id="")], [ev.TaskSpec(id="a"), ev.TaskSpec(id="a")]):
        with pytest.raises(InvalidEventError):
            scheduler.place_batch(batch)
    assert scheduler.graph.tasks == {}


def test_device_scores_flag_each_infeasible_device_with_its_constraint() -> None:
    scheduler = make_scheduler()
    scheduler.apply_telemetry(
        ev.TelemetryEvent(device_metrics=ev.DeviceMetrics(device_id="g1", health=ev.HEALTH_FAILED))
    )
    scores = scheduler.score_devices(
        ev.TaskSpec(id="t", memory_per_device_gb=20, allowed_kinds=[GPU]), ["g0", "g1", "tpu", "big", "nope"]
    )
    assert [s.device_id for s in scores] == ["g0", "g1", "tpu", "big", "nope"]
    assert [s.feasible for s in scores] == [True, False, False, True, False]
    assert [s.reason for s in scores] == ["", "health", "kind", "", "unknown device"]


def test_explain_lists_best_candidates_and_what_ruled_devices_out() -> None:
    scheduler = make_scheduler()
    spec = ev.TaskSpec(id="t", memory_per_device_gb=40)
    why = scheduler.explain(spec, top_k=1)
    assert [c.device_id for c in why.candidates] == ["big"]
    assert {(e.device_id, e.constraint) for e in why.excluded} == {
        ("g0", "memory"),
        ("g1", "memory"),
        ("tpu", "memory"),
    }
    assert why.placement is not None  # a hypothetical task: what would happen
    assert why.placement.sequence == 0
    submit(scheduler, ev.TaskSpec(id="waits", memory_per_device_gb=500))
    scheduler.schedule_pending()
    waiting = scheduler.explain("waits")
    assert waiting.pending is not None
    assert waiting.pending.queue_position == 1
    assert waiting.candidates == []
    with pytest.raises(UnknownTaskError):
        scheduler.explain("ghost")


def test_a_busy_device_too_small_for_the_task_is_ruled_out_by_memory_not_by_its_slot() -> None:
    """Every device busy: a task that fits once one frees up is told capacity; one too large for
    any device is told memory, the reason that lasts."""
    scheduler = make_scheduler()
    for i in range(4):
        submit(scheduler, ev.TaskSpec(id=f"busy-{i}", memory_per_device_gb=1))
    assert len(scheduler.schedule_pending()) == 4
    fits_later = scheduler.explain(ev.TaskSpec(id="later", memory_per_device_gb=8), top_k=1)
    assert {e.constraint for e in fits_later.excluded} == {"capacity"}
    never = scheduler.explain(ev.TaskSpec(id="never", memory_per_device_gb=500), top_k=1)
    assert {e.constraint for e in never.excluded} == {"memory"}
    assert all(" GB in all < 500.0 GB needed" in e.detail for e in never.excluded)


# -- never violated: random clusters, tasks and events -----------------------------------------

MODELS = ("m-a", "m-b")


@dataclass
class Op:
    kind: str
    pick: int = 0
    device: ev.Device | None = None
    specs: list[ev.TaskSpec] = field(default_factory=list)


@st.composite
def scenarios(draw: st.DrawFn) -> list[Op]:
    ops: list[Op] = []
    for i in range(draw(st.integers(1, 8))):
        spec = ev.Device(
            id=f"d{i}",
            host_id=f"h{draw(st.integers(0, 2))}",
            kind=draw(st.sampled_from([GPU, TPU])),
            model=draw(st.sampled_from(MODELS)),
            memory_gb=float(draw(st.integers(4, 80))),
        )
        ops.append(Op("device", device=spec))
    n_tasks = 0
    for _ in range(draw(st.integers(5, 40))):
        op = Op(draw(st.sampled_from(["submit", "submit", "finish", "fail", "used", "schedule", "batch", "dry"])))
        op.pick = draw(st.integers(0, 1000))
        if op.kind in ("submit", "batch", "dry"):
            for _ in range(draw(st.integers(1, 4)) if op.kind == "batch" else 1):
                deps = draw(st.lists(st.integers(0, max(0, n_tasks - 1)), max_size=2, unique=True)) if n_tasks else []
                op.specs.append(
                    ev.TaskSpec(
                        id=f"t{n_tasks}" if op.kind != "dry" else f"probe{len(op.specs)}",
                        num_devices=draw(st.integers(1, 3)),
                        memory_per_device_gb=float(draw(st.integers(0, 60))),
                        allowed_kinds=draw(st.lists(st.sampled_from([GPU, TPU]), max_size=1)),
                        allowed_models=draw(st.lists(st.sampled_from(MODELS), max_size=1)),
                        priority=draw(st.integers(0, 3)),
                        dependencies=[ev.Dependency(task_id=f"t{d}") for d in deps],
                    )
                )
                n_tasks += op.kind != "dry"
        ops.append(op)
    return ops


def _check_placements(scheduler: Scheduler, placements: list[ev.Placement], free_before: dict[str, float]) -> None:
    graph = scheduler.graph
    demand: dict[str, float] = {}
    for placement in placements:
        spec = graph.tasks[placement.task_id].spec
        ids = list(placement.device_ids)
        assert len(ids) == len(set(ids)) == max(1, spec.num_devices)
        for dep in spec.dependencies:
            assert graph.tasks[dep.task_id].state == TaskState.FINISHED
        for device_id in ids:
            row = graph.devices.index[device_id]
            assert graph.devices.health[row] != ev.HEALTH_FAILED
            assert not spec.allowed_kinds or graph.devices.kind[row] in spec.allowed_kinds
            assert not spec.allowed_models or graph.model_of(row) in spec.allowed_models
            demand[device_id] = demand.get(device_id, 0.0) + spec.memory_per_device_gb
    for device_id, gb in demand.items():
        assert gb <= free_before[device_id] + 1e-9, f"{device_id} overcommitted"


def _apply(scheduler: Scheduler, op: Op) -> list[ev.Placement]:
    graph = scheduler.graph
    rows = graph.devices.live_rows()
    holding = [t for t in graph.tasks.values() if t.state.holds_devices]
    if op.kind == "device" and op.device is not None:
        scheduler.apply_telemetry(ev.TelemetryEvent(device_upsert=op.device))
    elif op.kind == "submit":
        submit(scheduler, op.specs[0])
    elif op.kind == "batch":
        return [d.placement for d in scheduler.place_batch(op.specs) if d.placement is not None]
    elif op.kind == "dry":
        before = (graph.devices.reserved_gb.copy(), len(scheduler.ledger), len(graph.tasks))
        scheduler.place_batch(op.specs, dry_run=True)
        assert np.array_equal(before[0], graph.devices.reserved_gb)
        assert before[1:] == (len(scheduler.ledger), len(graph.tasks))
    elif op.kind == "schedule":
        return scheduler.schedule_pending()
    elif op.kind == "finish" and holding:
        task = holding[op.pick % len(holding)]
        scheduler.apply_task_event(ev.TaskEvent(finished=ev.TaskFinished(task_id=task.spec.id)))
    elif op.kind in ("fail", "used") and len(rows):
        row = int(rows[op.pick % len(rows)])
        metrics = ev.DeviceMetrics(device_id=graph.devices.ids[row] or "")
        if op.kind == "fail":
            metrics.health = ev.HEALTH_FAILED
        else:
            metrics.memory_used_gb = float(graph.devices.memory_gb[row]) * (op.pick % 10) / 10
        scheduler.apply_telemetry(ev.TelemetryEvent(device_metrics=metrics))
    return []


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.sampled_from(POLICY_NAMES))
def test_no_decision_ever_breaks_a_hard_constraint_or_places_a_task_twice(ops: list[Op], policy: str) -> None:
    scheduler = Scheduler(InfraGraph(), make_policy(policy, seed=1), PlacementLedger(), "c", clock=lambda: 0.0)
    graph = scheduler.graph
    for op in ops:
        rows = graph.devices.live_rows()
        free_before = dict(zip(graph.device_ids_of(rows), graph.free_memory_gb(rows).tolist(), strict=True))
        _check_placements(scheduler, _apply(scheduler, op), free_before)
        # hlb never reserves more than a device has, and counts the tasks on each device exactly.
        live = graph.devices.live_rows()
        assert (graph.devices.reserved_gb[live] <= graph.devices.memory_gb[live] + 1e-9).all()
        holders: dict[int, int] = {}
        for task in graph.tasks.values():
            if task.state.holds_devices:
                for row in task.device_rows:
                    holders[row] = holders.get(row, 0) + 1
        assert {int(r): int(graph.devices.n_tasks[r]) for r in live if graph.devices.n_tasks[r]} == holders
    placed_ids = [p.task_id for p in scheduler.ledger.since(1)]
    assert len(placed_ids) == len(set(placed_ids))


@pytest.mark.parametrize(
    ("policy", "weights", "per_device"),
    [
        ("least-loaded", None, 0),
        ("best-fit", None, 0),
        ("hetero-greedy", None, 0),
        ("heft", None, 0),
        # A batch rescores lazily: these exercise the utilization and energy terms and devices
        # that drop out of the feasible set as they fill up.
        ("hetero-greedy", {"completion_time": 1.0, "utilization": 0.5, "energy": 0.2}, 0),
        ("hetero-greedy", None, 3),
        ("least-loaded", None, 2),
        # The rules' presets cache the tasks no plugin touches; a service of the same shape is
        # fitted to its SLO (a filter) and must not take a cached answer.
        ("rules", None, 0),
        ("rules-table", None, 3),
    ],
)
def test_a_batch_decides_exactly_as_the_same_tasks_placed_one_by_one(
    policy: str, weights: dict[str, float] | None, per_device: int
) -> None:
    rng = np.random.default_rng(5)
    models = ["V100-SXM2-16GB", "A100-SXM4-80GB", "T4", "TPU-v4"]

    def cluster() -> Scheduler:
        shared = InfraGraph(max_tasks_per_device=per_device)  # 0: many placements per device, a long batch
        scheduler = Scheduler(shared, make_policy(policy, weights), PlacementLedger(), "c", clock=lambda: 0.0)
        for i in range(40):
            kind = TPU if models[i % 4] == "TPU-v4" else GPU
            spec = ev.Device(
                id=f"d{i}", host_id=f"h{i // 4}", kind=kind, model=models[i % 4], memory_gb=16 + 16 * (i % 5)
            )
            scheduler.apply_telemetry(ev.TelemetryEvent(device_upsert=spec))
        return scheduler

    specs = [
        ev.TaskSpec(
            id=f"t{i}",
            workload_class=["resnet50", "lm-bs20"][i % 2],
            num_devices=int(rng.integers(1, 4)),
            memory_per_device_gb=float(rng.choice([2.0, 10.0, 30.0])),
            work_ref_s=600.0,
            # A few name lists, beside plain tasks of the same shape otherwise (Task.plain).
            allowed_models=[models[i % 4], models[(i + 1) % 4]] if i % 7 == 3 else [],
            preferred_models=[models[i % 4]] if i % 11 == 5 else [],
            allowed_kinds=[GPU] if i % 13 == 6 else [],
            latency_slo_ms=20.0 if i % 5 == 2 else 0.0,
            labels={"request_rate_per_s": "20", "request_work_ref_ms": "5"} if i % 5 == 2 else {},
        )
        for i in range(120)
    ]
    batched = [d.placement for d in cluster().place_batch(specs)]
    one_by_one = cluster()
    single = [one_by_one.place(spec).placement for spec in specs]
    assert [p.device_ids if p else None for p in batched] == [p.device_ids if p else None for p in single]
    assert [p.score if p else None for p in batched] == [p.score if p else None for p in single]
    assert sum(p is not None for p in batched) > (60 if per_device == 0 else 30)


@pytest.mark.parametrize("policy", ["least-loaded", "best-fit", "hetero-greedy", "heft", "rules"])
@pytest.mark.parametrize("per_device", [0, 2])
def test_a_batch_of_one_device_tasks_decides_as_placing_them_one_by_one_by_priority(
    policy: str, per_device: int
) -> None:
    """The common batch: many one-device tasks of a few shapes, each binding making its device's
    score stale, devices filling up until they drop out, priorities reordering the batch."""
    rng = np.random.default_rng(11)
    models = ["V100-SXM2-16GB", "A100-SXM4-80GB", "T4"]

    def cluster() -> Scheduler:
        graph = InfraGraph(max_tasks_per_device=per_device)
        scheduler = Scheduler(graph, make_policy(policy), PlacementLedger(), "c", clock=lambda: 0.0)
        for i in range(24):
            spec = ev.Device(
                id=f"d{i}", host_id=f"h{i // 8}", kind=GPU, model=models[i % 3], memory_gb=16 + 8 * (i % 3)
            )
            scheduler.apply_telemetry(ev.TelemetryEvent(device_upsert=spec))
        return scheduler

    specs = [
        ev.TaskSpec(
            id=f"t{i}",
            workload_class="resnet50",
            memory_per_device_gb=float(rng.choice([3.0, 3.0, 3.0, 7.0])),
            work_ref_s=600.0,
            priority=int(rng.integers(0, 3)),
        )
        for i in range(150)
    ]
    batched = cluster().place_batch(specs)
    one_by_one = cluster()
    by_priority = sorted(range(len(specs)), key=lambda i: -specs[i].priority)
    decided = {i: one_by_one.place(specs[i]).placement for i in by_priority}
    single = [decided[i] for i in range(len(specs))]  # in request order, as the batch answers
    assert [d.placement.device_ids if d.placement else None for d in batched] == [
        p.device_ids if p else None for p in single
    ]
    assert [d.placement.score if d.placement else None for d in batched] == [p.score if p else None for p in single]
    placed = sum(d.placement is not None for d in batched)
    assert 20 < placed < len(specs)  # devices filled up and dropped out before the batch ended


def test_a_batch_names_its_first_bad_spec_as_checking_them_in_order_would() -> None:
    good = [ev.TaskSpec(id=f"t{i}", memory_per_device_gb=1.0) for i in range(6)]
    cases = {
        2: ev.TaskSpec(id="bad-memory", memory_per_device_gb=float("nan")),
        3: ev.TaskSpec(id="bad-kind", allowed_kinds=[GPU, ev.DeviceKind.ValueType(99)]),
        4: ev.TaskSpec(id="x" * 300),
        1: ev.TaskSpec(id="bad-dep", dependencies=[ev.Dependency(task_id="bad-dep")]),
    }
    for index, bad in cases.items():
        specs = [*good]
        specs[index] = bad
        specs[5] = ev.TaskSpec(id="later-bad", work_ref_s=-1.0)  # a later offender is not the one named
        scheduler = make_scheduler()
        with pytest.raises(InvalidEventError, match=rf"^tasks\[{index}\]: ") as caught:
            scheduler.place_batch(specs)
        with pytest.raises(InvalidEventError) as alone:
            scheduler.place(bad)
        assert str(caught.value) == f"tasks[{index}]: {alone.value}"
        assert scheduler.graph.tasks == {}


def _restarted_with(placement: ev.Placement) -> Scheduler:
    """A daemon after a restart: its ledger holds ``placement``, its graph only the devices."""
    ledger = PlacementLedger()
    ledger.restore([placement])
    return make_scheduler(ledger)


def test_place_for_a_task_the_ledger_already_placed_returns_that_placement() -> None:
    first = make_scheduler()
    spec = ev.TaskSpec(id="t1", memory_per_device_gb=8)
    placed = first.place(spec).placement
    assert placed is not None
    # After a restart, the client retries before the replay has reached the task's submission.
    restarted = _restarted_with(placed)
    again = restarted.place(spec)
    assert again.placement == placed
    assert len(restarted.ledger) == 1
    assert restarted.graph.devices.reserved_gb.sum() == 8
    # The same through PlaceBatch.
    batched = _restarted_with(placed)
    [decision] = batched.place_batch([spec])
    assert decision.placement == placed
    assert len(batched.ledger) == 1
    assert batched.graph.devices.reserved_gb.sum() == 8


def test_lifecycle_events_replayed_before_the_devices_apply_to_the_restored_placement() -> None:
    first = make_scheduler()
    placed = {t: first.place(ev.TaskSpec(id=t, memory_per_device_gb=8)).placement for t in ("done", "busy")}
    ledger = PlacementLedger()
    ledger.restore([p for p in placed.values() if p is not None])
    # On replay the tasks topic may be read before the telemetry topic that names the devices.
    restarted = Scheduler(InfraGraph(), LeastLoaded(), ledger, "c", clock=lambda: 2000.0)
    for task_id in ("done", "busy"):
        submit(restarted, ev.TaskSpec(id=task_id, memory_per_device_gb=8))
        restarted.apply_task_event(ev.TaskEvent(started=ev.TaskStarted(task_id=task_id)))
    restarted.apply_task_event(ev.TaskEvent(finished=ev.TaskFinished(task_id="done")))
    for event in [device("g0", "h0"), device("g1", "h0"), device("big", "h1", memory_gb=80)]:
        restarted.apply_telemetry(event)
    tasks = restarted.graph.tasks
    assert (tasks["done"].state, tasks["busy"].state) == (TaskState.FINISHED, TaskState.RUNNING)
    assert restarted.graph.devices.reserved_gb.sum() == 8  # only the running task holds memory
    assert restarted.schedule_pending() == []


def test_a_task_that_closes_a_dependency_cycle_is_refused() -> None:
    scheduler = make_scheduler()
    submit(scheduler, ev.TaskSpec(id="a", dependencies=[ev.Dependency(task_id="c")]))
    submit(scheduler, ev.TaskSpec(id="b", dependencies=[ev.Dependency(task_id="a")]))
    with pytest.raises(InvalidEventError) as refused:
        submit(scheduler, ev.TaskSpec(id="c", dependencies=[ev.Dependency(task_id="b")]))
    assert refused.value.reason == "cycle"
    assert "c" not in scheduler.graph.tasks
    # A diamond is not a cycle.
    submit(scheduler, ev.TaskSpec(id="d", dependencies=[ev.Dependency(task_id="a"), ev.Dependency(task_id="b")]))
    assert "d" in scheduler.graph.tasks
