"""Waiting for a faster busy device, shortest-first queue order, and services on the slowest devices
that meet their SLO: what the GNN policy may do and the baselines never do (``scheduler.rules.wait_for_faster``,
``scheduler.rules.queue_order``, ``scheduler.rules.fit_services``)."""

from __future__ import annotations

import numpy as np
import pytest

from hlb.daemon.config import RulesSettings
from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.presets import gnn_scorer, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.state.checks import check_task_spec, check_task_specs
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.profiles import default_profiles
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev
from tests.daemon.clock import T0, Clock

FAST, SLOW = "A100-SXM4-80GB", "V100-SXM2-32GB"


def ruled(
    wait_for_faster: bool = True, queue_order: str = "shortest-first", fit_services: bool = True, gang_wait: float = 0.5
) -> Policy:
    """The ``rules`` preset with these rules, its run times from the shipped (exact) profiles: the
    rules are plugins of any scorer, and these tests follow them, not a model's predictions."""
    rules = RulesSettings(
        wait_for_faster=wait_for_faster,
        queue_order=queue_order,
        fit_services=fit_services,
        gang_wait_factor=gang_wait,
    )
    return make_policy("rules", rules=rules)


def runtime_s(model: str, work_ref_s: float) -> float:
    graph = InfraGraph()
    graph.apply_telemetry(upsert(model))
    spec = ev.TaskSpec(id="probe", workload_class="resnet50", work_ref_s=work_ref_s, memory_per_device_gb=4)
    return float(default_profiles().runtime_s(graph, np.array([0]), spec)[0])


def upsert(model: str) -> ev.TelemetryEvent:
    device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
    return ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device)


def make_scheduler(policy: Policy, clock: Clock) -> Scheduler:
    scheduler = Scheduler(InfraGraph(), policy, PlacementLedger(), "c", clock=clock)
    for model in (FAST, SLOW):
        scheduler.apply_telemetry(upsert(model))
    scorer = gnn_scorer(policy)
    if scorer is not None:
        scorer.clock_ms = lambda: clock() * 1000.0
    return scheduler


def submit(scheduler: Scheduler, task_id: str, work_ref_s: float, **fields: object) -> None:
    spec = ev.TaskSpec(id=task_id, workload_class="resnet50", work_ref_s=work_ref_s, memory_per_device_gb=4, **fields)  # type: ignore[arg-type]
    scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=spec))


def finish(scheduler: Scheduler, task_id: str) -> None:
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id=task_id)))


def device_of(scheduler: Scheduler, task_id: str) -> str:
    placement = scheduler.ledger.get(task_id)
    return placement.device_ids[0] if placement is not None else ""


def busy_fast_device(scheduler: Scheduler, ends_in_s: float) -> None:
    """A task on the fast device that is expected to end ``ends_in_s`` from now."""
    submit(scheduler, "busy", work_ref_s=ends_in_s * 3600.0 / runtime_s(FAST, 3600.0))
    scheduler.schedule_pending()
    assert device_of(scheduler, "busy") == FAST
    expected = scheduler.graph.devices.free_at_ms[scheduler.graph.devices.index[FAST]]
    assert expected == pytest.approx((T0 + ends_in_s) * 1000.0, abs=2)


def test_a_task_waits_for_the_faster_busy_device_and_takes_it_once_free() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    submit(scheduler, "x", work_ref_s=3600.0)  # 1,000 + 1,470 s on the fast one against 3,600 s on the free one
    assert scheduler.schedule_pending() == []
    assert scheduler.waiting_count == 1
    reason = scheduler.lookup("x").pending
    assert reason is not None
    assert reason.reason.startswith(f"waiting for device {FAST}: expected free in 1,000 s")
    clock.t += 900.0
    finish(scheduler, "busy")
    placed = scheduler.schedule_pending()
    assert [p.task_id for p in placed] == ["x"]
    assert device_of(scheduler, "x") == FAST
    assert scheduler.waiting_count == 0


def test_tasks_waiting_for_one_device_queue_behind_each_other() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    submit(scheduler, "x", work_ref_s=3600.0)
    submit(scheduler, "y", work_ref_s=3600.0)  # behind x: 1,000 + 2 x 1,470 s > 3,600 s on the free one
    placed = scheduler.schedule_pending()
    assert [p.task_id for p in placed] == ["y"]
    assert device_of(scheduler, "y") == SLOW
    assert scheduler.lookup("x").pending is not None
    # x cancelled: what it held on the fast device is no longer counted for the next task.
    scheduler.apply_task_event(ev.TaskEvent(cell="c", cancelled=ev.EntityRef(id="x")))
    assert scheduler.device_waits.queued_s == {}


def test_a_device_overdue_by_longer_than_the_gain_is_not_waited_for() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    clock.t += 1000.0 + 2200.0  # overdue by 2,200 s: counted as 2,200 s more, 3,670 s > 3,600 s
    submit(scheduler, "x", work_ref_s=3600.0)
    placed = scheduler.schedule_pending()
    assert [p.task_id for p in placed] == ["x"]
    assert device_of(scheduler, "x") == SLOW


@pytest.mark.parametrize("policy", ["hetero-greedy", "heft", "least-loaded", "rules-no-wait"])
def test_the_baselines_and_the_rules_without_waiting_take_the_free_device(policy: str) -> None:
    clock = Clock()
    chosen = ruled(wait_for_faster=False) if policy == "rules-no-wait" else make_policy(policy)
    scheduler = make_scheduler(chosen, clock)
    submit(scheduler, "busy", work_ref_s=2448.0)
    scheduler.schedule_pending()
    busy_device = device_of(scheduler, "busy")
    submit(scheduler, "x", work_ref_s=3600.0)
    placed = scheduler.schedule_pending()
    assert [p.task_id for p in placed] == ["x"]
    assert device_of(scheduler, "x") not in ("", busy_device)


def test_a_dry_run_tells_of_the_wait_and_holds_nothing() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    spec = ev.TaskSpec(id="x", workload_class="resnet50", work_ref_s=3600.0, memory_per_device_gb=4)
    decision = scheduler.place(spec, dry_run=True)
    assert decision.pending is not None
    assert decision.pending.reason.startswith("waiting for device")
    assert scheduler.device_waits.queued_s == {}
    assert "x" not in scheduler.graph.tasks


def test_a_service_without_a_declared_load_never_waits() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    submit(scheduler, "svc", work_ref_s=3600.0, latency_slo_ms=50)
    placed = scheduler.schedule_pending()
    assert [p.task_id for p in placed] == ["svc"]
    assert device_of(scheduler, "svc") == SLOW
    # Without a declared load a service's end is not expected: the device it holds attracts no waiting task.
    assert scheduler.graph.devices.free_at_ms[scheduler.graph.devices.index[SLOW]] == 0


def test_queue_order_is_shortest_first_within_a_priority() -> None:
    clock = Clock()
    policy = ruled(wait_for_faster=False)
    scheduler = make_scheduler(policy, clock)
    submit(scheduler, "warm-up", work_ref_s=1.0)
    scheduler.schedule_pending()  # both devices busy from here on with the next two
    submit(scheduler, "filler", work_ref_s=99_999.0)
    scheduler.schedule_pending()
    for task_id, work, priority in [("long", 7200.0, 0), ("short", 600.0, 0), ("urgent", 99_000.0, 1)]:
        submit(scheduler, task_id, work_ref_s=work, priority=priority)
    submit(scheduler, "service", work_ref_s=86_400.0, latency_slo_ms=50)  # latency-bound: ahead of batch work
    # Without an estimate (work_ref_s 0) a task is not put behind others: arrival order among them.
    submit(scheduler, "unknown-pair", work_ref_s=0.0, num_devices=2)
    submit(scheduler, "unknown", work_ref_s=0.0)
    queue = ["urgent", "service", "unknown-pair", "unknown", "short", "long"]
    assert [t.spec.id for t in scheduler.queued()] == queue
    scheduler.policy = ruled(wait_for_faster=False, queue_order="arrival")
    assert [t.spec.id for t in scheduler.queued()] == ["urgent", "long", "short", "service", "unknown-pair", "unknown"]


def test_a_finished_task_clears_the_expected_end_of_its_device() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    finish(scheduler, "busy")
    assert scheduler.graph.tasks["busy"].state == TaskState.FINISHED
    assert scheduler.graph.devices.free_at_ms[scheduler.graph.devices.index[FAST]] == 0
    assert scheduler.device_waits.expected_end == {}


# -- services where they meet their SLO (scheduler.rules.fit_services) ------------------------------------

RATE_PER_S, REQUEST_MS = 40.0, 10.0  # 40 requests/s of 10 reference-device ms: a V100 would be 40% busy


def latency_ms(model: str) -> float:
    """The mean request latency (M/M/1) of the test's service on ``model``, from the device's speed."""
    service_ms = REQUEST_MS * runtime_s(model, 3600.0) / 3600.0
    return service_ms / (1.0 - RATE_PER_S * service_ms / 1000.0)


def submit_service(scheduler: Scheduler, task_id: str, slo_ms: float, lifetime_s: float = 7200.0) -> None:
    work_ref_s = RATE_PER_S * REQUEST_MS / 1000.0 * lifetime_s  # the request work of its lifetime
    labels = {"request_rate_per_s": repr(RATE_PER_S), "request_work_ref_ms": repr(REQUEST_MS)}
    submit(scheduler, task_id, work_ref_s, latency_slo_ms=slo_ms, kind=ev.TASK_KIND_INFERENCE, labels=labels)


def test_the_test_service_is_faster_on_the_fast_device() -> None:
    assert latency_ms(FAST) < latency_ms(SLOW) < 1.0e6


@pytest.mark.parametrize(
    ("slo_of", "fit", "device"),
    [
        (lambda: latency_ms(SLOW) * 1.01, True, SLOW),  # both meet it: the slower one
        (lambda: (latency_ms(FAST) + latency_ms(SLOW)) / 2, True, FAST),  # only the fast one meets it
        (lambda: latency_ms(FAST) * 0.5, True, FAST),  # none meets it: the fastest, as any task
        (lambda: latency_ms(SLOW) * 1.01, False, FAST),  # the rule off: the fastest, as any task
    ],
)
def test_a_service_takes_the_slowest_free_device_that_meets_its_slo(slo_of: object, fit: bool, device: str) -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(fit_services=fit), clock)
    submit_service(scheduler, "svc", slo_ms=slo_of())  # type: ignore[operator]
    assert [p.task_id for p in scheduler.schedule_pending()] == ["svc"]
    assert device_of(scheduler, "svc") == device
    # Its lifetime is known from its load: the device is expected free when it ends.
    row = scheduler.graph.devices.index[device]
    assert scheduler.graph.devices.free_at_ms[row] == pytest.approx((T0 + 7200.0) * 1000.0, abs=2)


def test_a_service_waits_for_a_busy_device_that_meets_its_slo_ahead_of_batch_work() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    submit(scheduler, "x", work_ref_s=3600.0)  # batch work waiting for the fast device too
    slo_ms = (latency_ms(FAST) + latency_ms(SLOW)) / 2
    submit_service(scheduler, "svc", slo_ms=slo_ms)
    # The service goes first and waits for the fast device; the batch task would now wait behind
    # the service's lifetime too, so it takes the slow one.
    assert [p.task_id for p in scheduler.schedule_pending()] == ["x"]
    assert device_of(scheduler, "x") == SLOW
    assert scheduler.device_waits.queued_s == {scheduler.graph.devices.index[FAST]: pytest.approx(7200.0)}
    pending = scheduler.lookup("svc").pending
    assert pending is not None
    assert pending.reason == (
        f"waiting for device {FAST}: expected free in 1,000 s, where it would meet its latency SLO"
        f" (estimated {latency_ms(SLOW):,.1f} ms on a device free now)"
    )
    clock.t += 1000.0
    finish(scheduler, "busy")
    assert [p.task_id for p in scheduler.schedule_pending()] == ["svc"]
    assert device_of(scheduler, "svc") == FAST


def test_a_service_no_device_could_serve_within_its_slo_does_not_wait() -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    busy_fast_device(scheduler, ends_in_s=1000.0)
    submit_service(scheduler, "svc", slo_ms=latency_ms(FAST) * 0.5)
    assert [p.task_id for p in scheduler.schedule_pending()] == ["svc"]
    assert device_of(scheduler, "svc") == SLOW


@pytest.mark.parametrize("value", ["fast", "0", "-3", "nan", "inf", "1e10"])
@pytest.mark.parametrize("label", ["request_rate_per_s", "request_work_ref_ms"])
def test_a_bad_declared_load_is_refused_naming_the_label(label: str, value: str) -> None:
    clock = Clock()
    scheduler = make_scheduler(ruled(), clock)
    labels = {"request_rate_per_s": "40", "request_work_ref_ms": "10", label: value}
    spec = ev.TaskSpec(id="svc", workload_class="resnet50", work_ref_s=10.0, latency_slo_ms=50, labels=labels)
    message = f"label {label}={value!r} is not a number"
    with pytest.raises(InvalidEventError, match=message):
        check_task_spec(spec)
    with pytest.raises(InvalidEventError, match=f"tasks\\[1\\]: task svc: {message}"):
        check_task_specs([ev.TaskSpec(id="ok"), spec])
    with pytest.raises(InvalidEventError):
        scheduler.place(spec)
    assert "svc" not in scheduler.graph.tasks


# -- a gang waiting for one host's faster devices (scheduler.rules.gang_wait_factor) ------------------------


def two_hosts(policy: Policy, clock: Clock) -> Scheduler:
    """Two devices of the fast model on host hf (f0, f1), two of the slow one on host hs (s0, s1)."""
    scheduler = Scheduler(InfraGraph(), policy, PlacementLedger(), "c", clock=clock)
    for host, model in (("hf", FAST), ("hs", SLOW)):
        for i in range(2):
            device = ev.Device(id=f"{host[1]}{i}", host_id=host, kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
            scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    scorer = gnn_scorer(policy)
    if scorer is not None:
        scorer.clock_ms = lambda: clock() * 1000.0
    return scheduler


def gang_runtimes_s(scheduler: Scheduler, work_ref_s: float) -> tuple[float, float]:
    """A gang of two's estimated run time on the fast host's pair and on the slow host's."""
    spec = ev.TaskSpec(
        id="probe", workload_class="resnet50", work_ref_s=work_ref_s, num_devices=2, memory_per_device_gb=4
    )
    graph = scheduler.graph
    rows = np.array([graph.devices.index[d] for d in ("f0", "f1", "s0", "s1")], dtype=np.int64)
    runtime = default_profiles().runtime_s(graph, rows, spec, 2, True)
    return float(runtime[:2].max()), float(runtime[2:].max())


def busy_fast_host(scheduler: Scheduler, ends_in_s: float) -> None:
    """A gang of two on the fast host, expected to end ``ends_in_s`` from now."""
    fast_s, _ = gang_runtimes_s(scheduler, 3600.0)
    submit(scheduler, "busy", work_ref_s=3600.0 * ends_in_s / fast_s, num_devices=2)
    scheduler.schedule_pending()
    assert sorted(scheduler.ledger.get("busy").device_ids) == ["f0", "f1"]  # type: ignore[union-attr]


@pytest.mark.parametrize(("share", "waits"), [(0.5, True), (1.5, False)])
def test_a_gang_waits_for_a_faster_host_only_when_it_finishes_under_the_factor(share: float, waits: bool) -> None:
    """Waiting ``share`` of the room the rule leaves (factor x the finish on the free slow host, less
    the run on the fast one): under it the gang waits and then takes the fast host, over it it takes
    the slow host now."""
    clock = Clock()
    scheduler = two_hosts(ruled(), clock)
    fast_s, slow_s = gang_runtimes_s(scheduler, 36_000.0)
    room_s = 0.5 * slow_s - fast_s
    assert room_s > 0  # the fast model is more than twice as fast: a gang may wait for it
    busy_fast_host(scheduler, ends_in_s=share * room_s)
    submit(scheduler, "g", work_ref_s=36_000.0, num_devices=2)
    placed = scheduler.schedule_pending()
    if not waits:
        assert [p.task_id for p in placed] == ["g"]
        assert sorted(scheduler.ledger.get("g").device_ids) == ["s0", "s1"]  # type: ignore[union-attr]
        return
    assert placed == []
    reason = scheduler.lookup("g").pending
    assert reason is not None
    assert reason.reason.startswith("waiting for 2 devices on the host of f")
    assert f"where it would finish in {share * room_s + fast_s:,.0f} s against {slow_s:,.0f} s" in reason.reason
    clock.t += share * room_s
    finish(scheduler, "busy")
    assert [p.task_id for p in scheduler.schedule_pending()] == ["g"]
    assert sorted(scheduler.ledger.get("g").device_ids) == ["f0", "f1"]  # type: ignore[union-attr]
    assert scheduler.waiting_count == 0


@pytest.mark.parametrize("policy", ["rules-factor-0", "rules-no-wait", "hetero-greedy"])
def test_a_gang_never_waits_with_the_factor_at_0_without_waiting_or_with_a_baseline(policy: str) -> None:
    clock = Clock()
    chosen = {
        "rules-factor-0": lambda: ruled(gang_wait=0.0),
        "rules-no-wait": lambda: ruled(wait_for_faster=False),
    }.get(policy, lambda: make_policy(policy))()
    scheduler = two_hosts(chosen, clock)
    fast_s, slow_s = gang_runtimes_s(scheduler, 36_000.0)
    busy_fast_host(scheduler, ends_in_s=0.1 * (0.5 * slow_s - fast_s))
    submit(scheduler, "g", work_ref_s=36_000.0, num_devices=2)
    assert [p.task_id for p in scheduler.schedule_pending()] == ["g"]
    assert sorted(scheduler.ledger.get("g").device_ids) == ["s0", "s1"]  # type: ignore[union-attr]


def test_a_gang_waiting_for_a_host_holds_nothing_on_a_dry_run() -> None:
    clock = Clock()
    scheduler = two_hosts(ruled(), clock)
    fast_s, slow_s = gang_runtimes_s(scheduler, 36_000.0)
    busy_fast_host(scheduler, ends_in_s=0.1 * (0.5 * slow_s - fast_s))
    spec = ev.TaskSpec(id="g", workload_class="resnet50", work_ref_s=36_000.0, num_devices=2, memory_per_device_gb=4)
    decision = scheduler.place(spec, dry_run=True)
    assert decision.pending is not None
    assert decision.pending.reason.startswith("waiting for 2 devices")
    assert scheduler.device_waits.queued_s == {}
