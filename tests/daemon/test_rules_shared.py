"""The rules on shared devices (``scheduler.rules.fragmentation_fit``, ``fragmentation_slack``,
``wait_on_shared``, and ``fit_services`` and ``queue_order`` for a task that asks for a share): no
wait that leaves a shareable device free, shares placed where fragmentation grows least among the
devices ranked within the slack of the best, services fitted by their share's speed, shares
ordered by their run time on their share, after whole-device work (``whole-first``)."""

from __future__ import annotations

import numpy as np
import pytest

from hlb.daemon.config import RulesSettings
from hlb.daemon.decide.framework import PermitRequest, PluginPolicy, Wait
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.rules import FragmentationScore, ShortestFirst, least_growth_within
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.waiting import SHARED_HEADROOM, slo_fit, whole_first_ranks
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.profiles import default_profiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev
from tests.daemon.clock import T0, Clock

FAST, SLOW = "A100-SXM4-80GB", "V100-SXM2-32GB"
MPS = ev.DEVICE_SHARING_MPS
RATE_PER_S, REQUEST_MS = 2.0, 50.0


def make_scheduler(clock: Clock, shareable: tuple[str, ...], **rules: object) -> Scheduler:
    """Both devices on one host, those in ``shareable`` shared by MPS; the ``rules`` preset."""
    policy = make_policy("rules", rules=RulesSettings(**rules))
    scheduler = Scheduler(InfraGraph(), policy, PlacementLedger(), "c", clock=clock)
    for model in (FAST, SLOW):
        sharing = MPS if model in shareable else ev.DEVICE_SHARING_UNSPECIFIED
        device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32, sharing=sharing)
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    return scheduler


def submit(scheduler: Scheduler, task_id: str, work_ref_s: float, **fields: object) -> None:
    spec = ev.TaskSpec(id=task_id, workload_class="resnet50", work_ref_s=work_ref_s, memory_per_device_gb=4, **fields)  # type: ignore[arg-type]
    scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=spec))


def device_of(scheduler: Scheduler, task_id: str) -> str:
    placement = scheduler.ledger.get(task_id)
    return placement.device_ids[0] if placement is not None else ""


def runtime_s(model: str, work_ref_s: float) -> float:
    graph = InfraGraph()
    device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
    graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    spec = ev.TaskSpec(id="probe", workload_class="resnet50", work_ref_s=work_ref_s, memory_per_device_gb=4)
    return float(default_profiles().runtime_s(graph, np.array([0]), spec)[0])


@pytest.mark.parametrize(("wait_on_shared", "waits"), [(False, False), (True, True)])
def test_a_task_does_not_wait_for_a_faster_device_leaving_a_shareable_one_free(
    wait_on_shared: bool, waits: bool
) -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(SLOW,), wait_on_shared=wait_on_shared)
    submit(scheduler, "busy", work_ref_s=1000.0 * 3600.0 / runtime_s(FAST, 3600.0))
    scheduler.schedule_pending()
    assert device_of(scheduler, "busy") == FAST
    # On the fast device after 1,000 s it would finish well before its 3,600 s on the free one.
    submit(scheduler, "x", work_ref_s=3600.0)
    placed = [p.task_id for p in scheduler.schedule_pending()]
    if waits:
        assert placed == []
        assert scheduler.waiting_count == 1
    else:
        assert placed == ["x"]
        assert device_of(scheduler, "x") == SLOW


@pytest.mark.parametrize("wait_on_shared", [False, True])
def test_the_framework_runs_no_permit_for_a_gang_on_shared_capacity_unless_told(wait_on_shared: bool) -> None:
    class Always:
        """A permit that always waits: whatever it is, the framework decides first."""

        name = "always"

        def applies(self, spec: ev.TaskSpec, gang: Rows) -> bool:
            return True

        def wait(self, request: PermitRequest) -> Wait | None:
            return Wait(int(request.gang[0]), "busy", 1.0, 1.0, 2.0)

    graph = InfraGraph()
    for model in (FAST, SLOW):
        sharing = MPS if model == SLOW else ev.DEVICE_SHARING_UNSPECIFIED
        device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32, sharing=sharing)
        graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    policy = PluginPolicy("p", make_policy("hetero-greedy"), permits=[Always()], wait_on_shared=wait_on_shared)
    spec = ev.TaskSpec(id="x", work_ref_s=60.0, memory_per_device_gb=4)
    exclusive, shareable = graph.devices.index[FAST], graph.devices.index[SLOW]
    assert policy.wait_for(spec, graph, np.array([exclusive]), 0.0, 0, {}) is not None
    assert (policy.wait_for(spec, graph, np.array([shareable]), 0.0, 0, {}) is not None) == wait_on_shared
    assert (policy.wait_for(spec, graph, np.array([exclusive, shareable]), 0.0, 0, {}) is not None) == wait_on_shared


def test_without_shared_devices_the_task_still_waits() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=())
    submit(scheduler, "busy", work_ref_s=1000.0 * 3600.0 / runtime_s(FAST, 3600.0))
    scheduler.schedule_pending()
    submit(scheduler, "x", work_ref_s=3600.0)
    assert scheduler.schedule_pending() == []
    assert scheduler.waiting_count == 1
    assert T0 > 0


@pytest.mark.parametrize(("fragmentation_fit", "device"), [(True, SLOW), (False, FAST)])
def test_a_share_goes_where_fragmentation_grows_least(fragmentation_fit: bool, device: str) -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(FAST, SLOW), fragmentation_fit=fragmentation_fit)
    submit(scheduler, "held", work_ref_s=36000.0, device_share_milli=600, allowed_models=[SLOW])
    scheduler.schedule_pending()
    assert device_of(scheduler, "held") == SLOW
    # 400 fills what the slow device has left, which a 600 request could not use: no fragment
    # remains; on the fast one it would leave the slow one's 400 free as a fragment. The scorer
    # alone prefers the fast device.
    submit(scheduler, "x", work_ref_s=3600.0, device_share_milli=400)
    assert [p.task_id for p in scheduler.schedule_pending()] == ["x"]
    assert device_of(scheduler, "x") == device


@pytest.mark.parametrize(("slack_of_gap", "device"), [(0.0, FAST), (0.9, FAST), (1.1, SLOW), (float("inf"), SLOW)])
def test_fragmentation_counts_only_among_devices_within_the_slack_of_the_best(slack_of_gap: float, device: str) -> None:
    # The slow device finishes the 400 share this share later than the fast one (both shares
    # alone on their device's capacity): a slack below that keeps the scorer's choice.
    gap = runtime_s(SLOW, 3600.0) / runtime_s(FAST, 3600.0) - 1.0
    assert gap > 0.1
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(FAST, SLOW), fragmentation_slack=slack_of_gap * gap)
    submit(scheduler, "held", work_ref_s=36000.0, device_share_milli=600, allowed_models=[SLOW])
    scheduler.schedule_pending()
    submit(scheduler, "x", work_ref_s=3600.0, device_share_milli=400)
    assert [p.task_id for p in scheduler.schedule_pending()] == ["x"]
    assert device_of(scheduler, "x") == device


def test_a_gang_of_shares_takes_more_devices_than_those_growing_fragmentation_least() -> None:
    # Only the slow device grows fragmentation least for a 400 share; a gang of two still takes
    # both devices (a filter keeping only the least-growth devices left it waiting forever).
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(FAST, SLOW))
    submit(scheduler, "held", work_ref_s=36000.0, device_share_milli=600, allowed_models=[SLOW])
    scheduler.schedule_pending()
    submit(scheduler, "gang", work_ref_s=3600.0, device_share_milli=400, num_devices=2)
    assert [p.task_id for p in scheduler.schedule_pending()] == ["gang"]
    placement = scheduler.ledger.get("gang")
    assert placement is not None
    assert sorted(placement.device_ids) == sorted([FAST, SLOW])


def test_explain_ranks_every_candidate_the_least_growth_first() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(FAST, SLOW))
    submit(scheduler, "held", work_ref_s=36000.0, device_share_milli=600, allowed_models=[SLOW])
    scheduler.schedule_pending()
    spec = ev.TaskSpec(
        id="what-if", workload_class="resnet50", work_ref_s=3600.0, memory_per_device_gb=4, device_share_milli=400
    )
    explanation = scheduler.explain(spec)
    assert [c.device_id for c in explanation.candidates] == [SLOW, FAST]
    # The scores are the scorer's values, reassigned: the best of them heads the list.
    plain = make_policy("hetero-greedy").score(spec, scheduler.graph, np.array([0, 1]))
    assert explanation.candidates[0].score == pytest.approx(float(plain.max()), rel=1e-6)


def test_least_growth_within_orders_the_band_by_growth_then_the_rest_by_score() -> None:
    scores = np.array([-1.0, -1.1, -1.5, -3.0, -1.05])
    growth = np.array([5.0, 1.0, 0.0, -9.0, 1.0])
    # Band (within 20% of -1.0): rows 0, 1, 4; by growth 1 (rows 4, 1 by score), then 5 (row 0);
    # then rows 2 and 3 by score, whatever their growth.
    out = least_growth_within(scores, growth, 0.2, 0.1)
    assert np.argsort(-out, kind="stable").tolist() == [4, 1, 0, 2, 3]
    assert sorted(out.tolist(), reverse=True) == pytest.approx(sorted(scores.tolist(), reverse=True), rel=1e-8)
    # No slack: exact ties of the best only; infinite: growth first.
    assert np.argsort(-least_growth_within(scores, growth, 0.0, 0.1)).tolist()[:1] == [0]
    assert np.argsort(-least_growth_within(scores, growth, float("inf"), 0.1)).tolist() == [3, 2, 4, 1, 0]
    tied = least_growth_within(np.array([-2.0, -2.0, -2.0]), np.array([3.0, 1.0, 2.0]), 0.0, 0.5)
    assert np.argsort(-tied).tolist() == [1, 2, 0]


def test_the_fragmentation_score_keeps_the_scorers_order_without_shared_devices() -> None:
    graph = InfraGraph()
    for model in (FAST, SLOW):
        device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
        graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    rows = np.array([0, 1])
    spec = ev.TaskSpec(id="s", device_share_milli=400, memory_per_device_gb=4)
    scores = np.array([-2.0, -1.0])
    assert FragmentationScore().rescore(spec, graph, rows, scores).tolist() == [-2.0, -1.0]
    assert not FragmentationScore().applies(ev.TaskSpec(id="w", memory_per_device_gb=4))


def test_a_negative_or_unknown_slack_is_refused() -> None:
    from pydantic import ValidationError

    for bad in (-0.1, float("nan"), "some"):
        with pytest.raises(ValidationError, match="fragmentation_slack"):
            RulesSettings(fragmentation_slack=bad)


def latency_ms(model: str, share: float) -> float:
    """The mean request latency (M/M/1) of the test's service on ``share`` of ``model``."""
    service_ms = REQUEST_MS * runtime_s(model, 3600.0) / 3600.0 / share
    rho = RATE_PER_S * service_ms / 1000.0
    return service_ms / (1.0 - rho) if rho < 1.0 else float("inf")


def test_a_service_on_a_share_is_fitted_by_its_shares_speed() -> None:
    # Half of each device, counted at SHARED_HEADROOM of that for co-runners: only the fast one
    # meets the SLO so, though the whole slow device would (where the rule used to fit it).
    share = 0.5 * SHARED_HEADROOM
    slo = latency_ms(FAST, share) * 1.01
    assert latency_ms(SLOW, 1.0) < slo < latency_ms(SLOW, share)
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(FAST, SLOW), fragmentation_fit=False)
    labels = {"request_rate_per_s": repr(RATE_PER_S), "request_work_ref_ms": repr(REQUEST_MS)}
    work_ref_s = RATE_PER_S * REQUEST_MS / 1000.0 * 7200.0
    submit(
        scheduler,
        "svc",
        work_ref_s,
        latency_slo_ms=slo,
        kind=ev.TASK_KIND_INFERENCE,
        labels=labels,
        device_share_milli=500,
    )
    assert [p.task_id for p in scheduler.schedule_pending()] == ["svc"]
    assert device_of(scheduler, "svc") == FAST


def test_shortest_first_counts_a_share_at_its_share_of_the_device() -> None:
    graph = InfraGraph()
    device = ev.Device(id=FAST, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=FAST, memory_gb=32, sharing=MPS)
    graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    whole = ev.TaskSpec(id="whole", workload_class="resnet50", work_ref_s=1800.0, memory_per_device_gb=4)
    # 1,000 s of work on a quarter of the device: 4,000 s, longer than the whole task's 1,800 s.
    share = ev.TaskSpec(
        id="share", workload_class="resnet50", work_ref_s=1000.0, memory_per_device_gb=4, device_share_milli=250
    )
    ranks = ShortestFirst(default_profiles()).rank(graph, [Task(whole, "c", 0), Task(share, "c", 1)])
    assert ranks is not None
    assert ranks[0] > ranks[1]  # the whole task first
    assert ranks[1] == pytest.approx(4.0 * runtime_s(FAST, 1000.0) * -1.0)


def test_whole_first_puts_whole_device_work_before_shares_and_keeps_each_shortest_first() -> None:
    graph = InfraGraph()
    device = ev.Device(id=FAST, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=FAST, memory_gb=32, sharing=MPS)
    graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))

    def spec(task_id: str, work_s: float, share: int = 0, slo_ms: float = 0.0) -> ev.TaskSpec:
        return ev.TaskSpec(
            id=task_id,
            workload_class="resnet50",
            work_ref_s=work_s,
            memory_per_device_gb=4,
            device_share_milli=share,
            latency_slo_ms=slo_ms,
        )

    specs = [
        spec("long-whole", 9000.0),
        spec("short-share", 100.0, share=500),  # 200 s on its share: shorter than every whole task
        spec("short-whole", 1800.0),
        spec("long-share", 3000.0, share=500),
        spec("service-share", 100.0, share=500, slo_ms=50.0),
    ]
    tasks = [Task(s, "c", i) for i, s in enumerate(specs)]
    for whole_first, expected in (
        (True, ["service-share", "short-whole", "long-whole", "short-share", "long-share"]),
        (False, ["service-share", "short-share", "short-whole", "long-share", "long-whole"]),
    ):
        ranks = ShortestFirst(default_profiles(), whole_first=whole_first).rank(graph, tasks)
        assert ranks is not None
        order = sorted(range(len(tasks)), key=lambda i: (-ranks[i], i))
        assert [specs[i].id for i in order] == expected


def test_whole_first_orders_as_shortest_first_where_no_task_asks_for_a_share() -> None:
    rng = np.random.default_rng(7)
    ranks = np.where(rng.random(200) < 0.2, 0.0, -rng.lognormal(8.0, 2.5, 200))  # a fifth unranked
    shares = np.zeros(200, dtype=np.bool_)
    whole_first = whole_first_ranks(ranks, shares)
    assert np.array_equal(np.argsort(-whole_first, kind="stable"), np.argsort(-ranks, kind="stable"))
    assert np.all((whole_first > -1.0) & (whole_first <= 0.0))
    # The same run times asked as shares: all after, in the same order among themselves.
    mixed = whole_first_ranks(np.concatenate([ranks, ranks]), np.repeat([False, True], 200))
    assert np.max(mixed[200:][ranks < 0]) < np.min(mixed[:200])
    assert np.array_equal(np.argsort(-mixed[200:], kind="stable"), np.argsort(-ranks, kind="stable"))


def test_whole_first_puts_an_endless_estimate_last_of_its_kind_never_nan() -> None:
    ranks = np.array([-np.inf, -10.0, 0.0, -np.inf, -5.0])
    shares = np.array([False, False, False, True, True])
    out = whole_first_ranks(ranks, shares)
    assert not np.isnan(out).any()
    assert list(np.argsort(-out, kind="stable")) == [2, 1, 0, 4, 3]


@pytest.mark.parametrize(("service", "device"), [(False, SLOW), (True, FAST)])
def test_a_share_service_no_device_fits_takes_the_fastest_share_not_the_least_fragmenting(
    service: bool, device: str
) -> None:
    # 300 of the slow device's 1,000 milli-devices are taken: 700 more there fill it, where
    # fragmentation grows least (on the fast device they would leave 300 that no 700 fits). A share
    # without a declared load goes there; a service whose SLO no share meets by its estimate takes
    # the fastest share instead (the fit's fallback), not the least fragmenting.
    clock = Clock()
    scheduler = make_scheduler(clock, shareable=(FAST, SLOW))
    submit(scheduler, "held", 36_000.0, device_share_milli=300, allowed_models=[SLOW])
    assert [p.task_id for p in scheduler.schedule_pending()] == ["held"]
    fields: dict[str, object] = {"device_share_milli": 700}
    if service:
        labels = {"request_rate_per_s": repr(RATE_PER_S), "request_work_ref_ms": repr(REQUEST_MS)}
        slo = 0.5 * latency_ms(FAST, 0.7 * SHARED_HEADROOM)
        fields |= {"latency_slo_ms": slo, "kind": ev.TASK_KIND_INFERENCE, "labels": labels}
    submit(scheduler, "next", RATE_PER_S * REQUEST_MS / 1000.0 * 7200.0, **fields)
    assert [p.task_id for p in scheduler.schedule_pending()] == ["next"]
    assert device_of(scheduler, "next") == device


def test_a_whole_device_service_no_device_fits_keeps_every_device_for_its_scorer() -> None:
    graph = InfraGraph()
    for model in (FAST, SLOW):
        device = ev.Device(id=model, host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
        graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    labels = {"request_rate_per_s": repr(RATE_PER_S), "request_work_ref_ms": repr(REQUEST_MS)}
    spec = ev.TaskSpec(
        id="svc",
        workload_class="resnet50",
        memory_per_device_gb=4,
        latency_slo_ms=0.5 * latency_ms(FAST, 1.0),
        kind=ev.TASK_KIND_INFERENCE,
        labels=labels,
    )
    rows = np.array([0, 1])
    assert slo_fit(spec, graph, rows, default_profiles()).tolist() == [0, 1]
    spec.device_share_milli = 500
    assert [graph.devices.ids[r] for r in slo_fit(spec, graph, rows, default_profiles())] == [FAST]
