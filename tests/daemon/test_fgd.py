"""Fragmentation of shared devices and the FGD-style baseline (``hlb.daemon.decide.fgd``): the
measure against hand-counted cases, the delta it scores by, and where the policy places."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hlb.daemon.decide.fgd import (
    FragmentationGradient,
    RequestMix,
    cluster_fragmentation_gpus,
    fragmentation_delta,
    fragmentation_milli,
    free_milli,
    held_mix,
)
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

MPS = ev.DEVICE_SHARING_MPS


def make_scheduler(policy: str = "least-loaded") -> Scheduler:
    return Scheduler(InfraGraph(1), make_policy(policy), PlacementLedger(), "c", clock=lambda: 0.0)


def upsert(scheduler: Scheduler, device_id: str, memory_gb: float = 80, **fields: object) -> None:
    spec = ev.Device(id=device_id, host_id="h0", kind=ev.DEVICE_KIND_GPU, model="A100", memory_gb=memory_gb, **fields)  # type: ignore[arg-type]
    scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=spec))


def partitioned(scheduler: Scheduler, parent: str, shares: tuple[int, ...] = (428, 285, 142, 142)) -> None:
    upsert(scheduler, parent)
    for i, share in enumerate(shares):
        upsert(scheduler, f"{parent}/mig{i}", memory_gb=10, parent_id=parent, compute_share_milli=share)


def task(task_id: str, share: int = 0, memory_gb: float = 4, gang: int = 1) -> ev.TaskSpec:
    return ev.TaskSpec(id=task_id, device_share_milli=share, memory_per_device_gb=memory_gb, num_devices=gang)


def place(scheduler: Scheduler, spec: ev.TaskSpec) -> list[str]:
    decision = scheduler.place(spec)
    assert decision.placement is not None
    return list(decision.placement.device_ids)


def test_a_request_mix_weights_each_type_by_its_count() -> None:
    mix = RequestMix.of([(500, 4.0), (500, 4.0), (0, 8.0), (250, 4.0)])
    assert dict(zip(mix.share_milli.tolist(), mix.weight.tolist(), strict=True)) == {500: 0.5, 0: 0.25, 250: 0.25}
    with pytest.raises(ValueError, match="at least one"):
        RequestMix.of([])


def test_free_capacity_no_request_can_use_is_fragmentation() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS)
    upsert(scheduler, "g1", sharing=MPS)
    place(scheduler, task("a", 700))  # least-loaded: g0 holds 700, 300 free
    graph = scheduler.graph
    # Half the requests ask for 500 (300 free is no use to them), half for a whole device (a device
    # holding a share is no use to them): g0's 300 free is a fragment for both; g1 is free whole.
    mix = RequestMix.of([(500, 4.0), (0, 4.0)])
    assert free_milli(graph) == 1300
    assert fragmentation_milli(graph, mix) == pytest.approx(300)
    # Requests of 200 use g0's 300: no fragment for them.
    assert fragmentation_milli(graph, RequestMix.of([(200, 4.0)])) == 0
    # Memory counts: 76 GB of g0 are free, so a 200 needing 79 GB cannot use its 300; g1 it can.
    assert fragmentation_milli(graph, RequestMix.of([(200, 79.0)])) == pytest.approx(300)


def test_partitions_offer_their_compute_share_to_requests_no_larger() -> None:
    scheduler = make_scheduler()
    partitioned(scheduler, "a100")
    graph = scheduler.graph
    # Each physical device counted once: through its partitions (428 + 285 + 142 + 142).
    assert free_milli(graph) == 997
    # 300 fits only the 428 partition: the other three (569) are fragments; a whole request takes
    # the parent while no partition holds a task: no fragment for it.
    assert fragmentation_milli(graph, RequestMix.of([(300, 4.0)])) == pytest.approx(569)
    assert fragmentation_milli(graph, RequestMix.of([(0, 4.0)])) == 0
    assert place(scheduler, task("small", 100)) == ["a100/mig0"]  # least-loaded: the emptiest
    assert free_milli(graph) == 997 - 428
    # Once a partition holds a task, the parent cannot be taken whole: what is free is a fragment.
    assert fragmentation_milli(graph, RequestMix.of([(0, 4.0)])) == pytest.approx(free_milli(graph))


def test_the_delta_is_the_change_of_fragmentation_a_placement_would_make() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS)
    upsert(scheduler, "g1", sharing=MPS)
    partitioned(scheduler, "a100")
    upsert(scheduler, "x0")  # exclusive, no partitions
    place(scheduler, task("a", 470))
    mix = RequestMix.of([(470, 4.0), (810, 4.0), (100, 4.0), (0, 4.0), (0, 4.0)])
    before = fragmentation_milli(scheduler.graph, mix)
    for spec in (task("share", 100), task("whole")):
        candidates = scheduler.graph.feasible_rows(spec)
        deltas = fragmentation_delta(scheduler.graph, spec, candidates, mix)
        assert len(candidates) >= 3
        for row, delta in zip(candidates.tolist(), deltas.tolist(), strict=True):
            # The same placement done for real on a copy of the graph.
            graph = copy.deepcopy(scheduler.graph)
            graph.bind(Task(spec=spec, cell="c", arrival=0), [row])
            assert delta == pytest.approx(fragmentation_milli(graph, mix) - before), graph.devices.ids[row]


def test_fgd_packs_shares_and_keeps_whole_devices_and_partitions_for_what_fits_them() -> None:
    scheduler = make_scheduler("fgd")
    upsert(scheduler, "g0", sharing=MPS)
    upsert(scheduler, "g1", sharing=MPS)
    partitioned(scheduler, "a100")
    assert isinstance(scheduler.policy, FragmentationGradient)
    # Whole requests and 470s make the mix the policy learns from what it places.
    for i in range(4):
        scheduler.policy.placed(task(f"w{i}"), scheduler.graph, np.zeros(0, dtype=np.int64))
    first = place(scheduler, task("s0", 470))
    second = place(scheduler, task("s1", 470))
    # The second 470 joins the first on its shared device rather than break another device.
    assert first == second
    assert first[0] in ("g0", "g1")


def test_fgd_puts_a_small_share_where_larger_requests_could_not_go() -> None:
    scheduler = make_scheduler("fgd")
    upsert(scheduler, "g0", sharing=MPS)
    partitioned(scheduler, "a100")
    for i in range(4):
        for share in (400, 100):
            scheduler.policy.placed(task(f"m{i}-{share}", share), scheduler.graph, np.zeros(0, dtype=np.int64))
    # The 2g (285) and 1g (142) partitions are of no use to the 400s: the 100 takes the one whose
    # loss removes most of that fragment, the 2g, rather than the 3g (428) a 400 could use or the
    # shared device.
    assert place(scheduler, task("tiny", 100)) == ["a100/mig1"]


def test_fgd_decides_like_hetero_greedy_where_nothing_is_shared() -> None:
    fgd, greedy = make_scheduler("fgd"), make_scheduler("hetero-greedy")
    for scheduler in (fgd, greedy):
        for i, model in enumerate(("A100", "V100", "K80")):
            spec = ev.Device(id=f"d{i}", host_id="h0", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
            scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=spec))
    specs = [ev.TaskSpec(id=f"t{i}", workload_class="resnet50-bs64", work_ref_s=600, num_devices=1) for i in range(3)]
    assert [place(fgd, s) for s in specs] == [place(greedy, s) for s in specs]


def test_the_daemon_s_fragmentation_is_against_the_requests_of_the_tasks_it_holds() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "x0")  # exclusive: nothing shared, nothing to measure
    assert cluster_fragmentation_gpus(scheduler.graph) is None
    upsert(scheduler, "g0", sharing=MPS)
    assert cluster_fragmentation_gpus(scheduler.graph) is None  # no task: no request to measure against
    place(scheduler, task("a", 700))
    assert scheduler.place(task("b", 500)).placement is None  # g0 holds 700: b waits
    mix = held_mix(scheduler.graph)
    assert mix is not None
    assert dict(zip(mix.share_milli.tolist(), mix.weight.tolist(), strict=True)) == {700: 0.5, 500: 0.5}
    # g0's 300 free is no use to either; x0 (free, exclusive) is no use to shares.
    assert cluster_fragmentation_gpus(scheduler.graph) == pytest.approx(0.3 + 1.0)
